"""What the app pays in memory to open a database's attribution cache, measured in the app's own process.

    python -m bench.attribution_memory --db runs/attr-scaling/n24576.duckdb --clicks 20

Loads the studio (model and database) as app.py does, generates a text, and reads this process's resident memory
(/proc/self/status: RssAnon, memory of its own, and RssFile, pages of mapped files the kernel can drop and read
again) before the first attribution query, after the index is loaded (memory-mapped under the user cache, as the
app does; --in-memory loads it into memory instead) and after --clicks queries on the generated tokens. Prints one
JSON line; the figure to judge is extra_anon_mb (issue 19: at most about 1 GB for a 24,576-sequence cache). The
first open of a database writes its memory-mapped index from a child process (precompute/attribution/cache.py);
that process's peak is index_writer_peak_rss_mb (null when the folder already existed).
"""

from __future__ import annotations

import resource
import time

from app.attribution import attribute_token, index_for
from app.core import GenerationSettings, Studio
from prism import cli

PROMPT = "In the beginning the people of the valley"


def rss_mb() -> dict[str, float]:
    """This process's resident memory from /proc/self/status, in MB: total, anonymous, file-backed, shared."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                fields[key] = int(value.split()[0]) / 1024  # kB
    return {"rss": round(fields["VmRSS"], 1), "anon": round(fields["RssAnon"], 1), "file": round(fields["RssFile"], 1),
            "shmem": round(fields.get("RssShmem", 0.0), 1)}


def main(argv: list[str] | None = None) -> dict:
    parser = cli.parser("python -m bench.attribution_memory", __doc__)
    parser.add_argument("--model", default="assets/model", help="PRISM model folder (default: the shipped one)")
    parser.add_argument("--db", required=True, help="a precompute database with an attribution cache")
    parser.add_argument("--clicks", type=int, default=20, help="attribution queries after loading")
    parser.add_argument("--tokens", type=int, default=24, help="tokens generated (queries go round them)")
    parser.add_argument("--in-memory", action="store_true", help="load the index into memory, not memory-mapped")
    args = cli.parse(parser, argv)
    if args.clicks < 1 or args.tokens < 1:
        cli.fail(parser, "--clicks and --tokens must be >= 1")
    with cli.expected_errors(parser, FileNotFoundError, ValueError):
        studio = Studio.load(args.model, args.db)
    if studio.db is None:
        cli.fail(parser, f"could not open {args.db}: {studio.db_error}")
    gen = studio.generate(GenerationSettings(PROMPT, max_new_tokens=args.tokens, temperature=0.0, seed=0))
    before = rss_mb()
    start = time.perf_counter()
    if args.in_memory:
        import app.attribution as panel
        from precompute import attribution as cache

        panel._indexes[studio.db] = studio.db.run(cache.load_index, studio.model.lm_head.weight)
    index = index_for(studio, studio.db)
    load_s = time.perf_counter() - start
    loaded = rss_mb()
    times = []
    for click in range(args.clicks):
        t0 = time.perf_counter()
        attribute_token(studio, gen, click % len(gen.steps))
        times.append(time.perf_counter() - t0)
    after = rss_mb()
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # the index writer, if it ran
    result = {"db": args.db, "n_sequences": index.n_sequences, "memory_mapped": not args.in_memory,
              "exact_store": index.exact is not None, "rerank": index.rerank,
              "index_writer_peak_rss_mb": round(children, 1) if children else None,
              "load_s": round(load_s, 2), "clicks": args.clicks, "click_ms_median": round(
                  1e3 * sorted(times)[len(times) // 2], 1),
              "before_mb": before, "loaded_mb": loaded, "after_mb": after,
              "extra_anon_mb": round(after["anon"] - before["anon"], 1),
              "extra_rss_mb": round(after["rss"] - before["rss"], 1)}
    cli.print_json(result)
    return result


if __name__ == "__main__":
    main()
