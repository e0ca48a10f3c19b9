"""Latency of the query layer (what the app calls per click), p50/p95 over many calls.

    python -m bench.query_latency --db out.duckdb                       # as built
    python -m bench.query_latency --db out.duckdb --scale-to 16384      # replicated to a 16k-prototype bank

--scale-to writes a copy whose prototypes are the built ones repeated (ids shifted, every row kept) until the
bank has that many prototypes, so latencies are measured at the size of a real large model's database. Prints
one JSON line with p50/p95 in milliseconds per query kind.
"""

from __future__ import annotations

import random
import shutil
import statistics
import time
from pathlib import Path

import duckdb

from precompute import query
from precompute.schema import JOB_TABLES
from prism import cli

PER_PROTOTYPE = [t for tables in JOB_TABLES.values() for t in tables if t != "documents"]


def scale_copy(src: Path, dst: Path, target: int) -> int:
    """Copy src to dst and repeat its prototypes (shifted ids) until there are `target`; returns the count."""
    shutil.copyfile(src, dst)
    con = duckdb.connect(str(dst))
    k = con.execute("SELECT count(*) FROM prototype_stats").fetchone()[0]
    copies = max(1, -(-target // k))
    for table in PER_PROTOTYPE:
        columns = [r[0] for r in con.execute(f"DESCRIBE {table}").fetchall()]
        shifted = ", ".join("prototype_id + ? * c AS prototype_id" if c == "prototype_id" else
                            ("other_id + ? * c AS other_id" if c == "other_id" else c) for c in columns)
        n_params = shifted.count("?")
        con.execute(f"INSERT INTO {table} SELECT {shifted} FROM {table}, range(1, ?) AS r(c)",
                    [k] * n_params + [copies])
    con.execute("CHECKPOINT")
    n = con.execute("SELECT count(*) FROM prototype_stats").fetchone()[0]
    con.close()
    return n


def timed(fn, repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return {"p50_ms": statistics.median(times), "p95_ms": times[min(len(times) - 1, int(0.95 * len(times)))]}


def main(argv: list[str] | None = None) -> dict:
    parser = cli.parser("python -m bench.query_latency", __doc__, formatter="plain")
    parser.add_argument("--db", required=True)
    parser.add_argument("--scale-to", type=int, default=None, help="replicate prototypes up to this many")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args(argv)
    db = Path(ns.db)
    if ns.scale_to:
        scaled = db.with_name(db.stem + f"-x{ns.scale_to}.duckdb")
        scaled.unlink(missing_ok=True)
        scale_copy(db, scaled, ns.scale_to)
        db = scaled
    con = query.open_db(db)
    k = query.n_prototypes(con)
    rng = random.Random(ns.seed)
    ids = [rng.randrange(k) for _ in range(ns.repeats)]
    it = iter(ids * 3)
    result = {"db": db.name, "n_prototypes": k,
              "evidence_rows": con.execute("SELECT count(*) FROM evidence").fetchone()[0],
              "prototype_card": timed(lambda: query.prototype_card(con, next(it)), ns.repeats),
              "evidence_top8": timed(lambda: query.evidence(con, next(it), limit=8), ns.repeats),
              "prototype_table": timed(lambda: query.prototype_table(con, limit=500), max(10, ns.repeats // 10)),
              "map_points": timed(lambda: query.map_points(con), max(10, ns.repeats // 10))}
    if con.execute("SELECT count(*) FROM labels").fetchone()[0]:
        from precompute import search

        words = ["number", "year", "name", "verb", "bible", "city", "science", "suffix", "punctuation", "money"]
        w = iter(words * ns.repeats)
        result["label_search"] = timed(lambda: search.label_search(con, next(w)), ns.repeats)
        if con.execute("SELECT count(*) FROM embeddings").fetchone()[0]:
            result["semantic_search"] = timed(lambda: search.semantic_search(con, next(w)), ns.repeats // 4)
    cli.print_json(result)
    return result


if __name__ == "__main__":
    main()
