"""The bands job: a uniform sample of every prototype's active positions, so a card can show contexts from across
the activation range (top, middle, low), not only the strongest ones the evidence job keeps.

    python -m precompute.bands --model runs/prism/final --corpus default --db out.duckdb --sample-n 64
    python -m precompute build ... --jobs bands
    python -m precompute.bands trim --db out.duckdb --corpus default --sample-n 24   # keep a smaller sample

How it runs: the evidence job's own pass (precompute/evidence.py: the same windows, chunks, checkpoints, ranks and
merge), ranked by a priority instead of the activation. Each active (prototype, document, position) gets a number
u in [0, 1) from a hash of the three, and the sample_n highest u per prototype are kept: a uniform sample without
replacement of the prototype's active positions (a bottom-k sketch), the same rows whatever the chunk size, the
number of ranks, or where a killed run resumed. Rows are written to evidence_bands (the evidence table's columns,
ranked by activation) and their documents to band_documents.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np

from precompute import evidence
from precompute.inputs import Context, Job, add_input_arguments, job_command, load_corpus
from precompute.runs import canonical_args, connect, transaction
from prism import PrismForCausalLM, cli
from prism.cli import arg

NAME = "bands"  # the job's row in `runs`, its tables in schema.JOB_TABLES
POSITION_BITS = evidence.POSITION_BITS  # a key is document index << POSITION_BITS | token position
_EVIDENCE = evidence.EvidenceArgs()


@dataclass
class BandsArgs:
    sample_n: int = arg(64, "active positions sampled per prototype, uniformly")
    seq_len: int = arg(_EVIDENCE.seq_len, "tokens per model input window")
    batch_size: int = arg(_EVIDENCE.batch_size, "windows per forward pass")
    context_before: int = arg(_EVIDENCE.context_before, "context tokens kept before the sampled token")
    context_after: int = arg(_EVIDENCE.context_after, "context tokens kept after it (within the same input window)")
    docs_per_chunk: int = arg(_EVIDENCE.docs_per_chunk, "documents per committed chunk (a killed job resumes "
                                                        "after the last one)")
    limit: int | None = arg(None, "read at most this many documents")

    def __post_init__(self) -> None:
        for name in ("sample_n", "seq_len", "batch_size", "docs_per_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def priority(proto: np.ndarray, key: np.ndarray) -> np.ndarray:
    """u in [0, 1) per (prototype, key = document index and token position): splitmix64's finaliser over both,
    so every position is a fair, independent draw for every prototype, and the same draw on every run."""
    x = (key.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ (proto.astype(np.uint64) *
                                                                     np.uint64(0xC2B2AE3D27D4EB4F))
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


class SampleState(evidence.RankState):
    """The evidence job's running state, ranked by priority(); no statistics (the evidence job keeps those)."""

    ENTRY_FIELDS = {**evidence.RankState.ENTRY_FIELDS, "prio": (np.float64, -np.inf)}
    SCORE = "prio"

    def __init__(self, n_prototypes: int, args: BandsArgs) -> None:
        super().__init__(n_prototypes, evidence.EvidenceArgs(
            top_n=args.sample_n, seq_len=args.seq_len, batch_size=args.batch_size, context_before=args.context_before,
            context_after=args.context_after, n_bins=1, docs_per_chunk=args.docs_per_chunk, limit=args.limit))
        self.coact = None  # K x K counts the sample does not need

    def add_stats(self, ids: np.ndarray, acts: np.ndarray) -> None:
        self.tokens += len(ids)

    def score(self, proto: np.ndarray, act: np.ndarray, key: np.ndarray) -> np.ndarray:
        return priority(proto, key)


def merge(con: duckdb.DuckDBPyConnection, work: Path, model: PrismForCausalLM, tokenizer, args: BandsArgs,
          world: int) -> dict:
    """Every rank's sample, cut to the sample_n highest priorities per prototype, ranked by activation."""
    missing = [r for r in range(world) if not (work / f"shard-rank{r}.done").exists()]
    if missing:
        raise RuntimeError(f"cannot merge: ranks {missing} have not finished their shards in {work}")
    files = {name: [str(work / f"{name}-rank{r}.parquet") for r in range(world)] for name in ("entries", "docs")}
    top = con.execute(f"""
        SELECT * EXCLUDE (r) FROM (
            SELECT *, row_number() OVER (PARTITION BY prototype_id ORDER BY score DESC, key ASC) - 1 AS r
            FROM read_parquet(?)) WHERE r < {int(args.sample_n)}
        ORDER BY prototype_id, activation DESC, key ASC""", [files["entries"]]).fetch_df()
    top["rank"] = top.groupby("prototype_id").cumcount().astype(np.int32)
    docs = evidence.referenced_documents(con, files["docs"], top)
    evidence.write_tables(con, NAME, {"band_documents": evidence.documents_rows(docs),
                                      "evidence_bands": evidence.evidence_rows(top, docs)})
    tokens = sum(json.loads((work / f"shard-rank{r}.done").read_text())["tokens"] for r in range(world))
    return {"tokens": tokens, "sampled_rows": len(top), "documents": len(docs),
            "prototypes": int(top["prototype_id"].nunique()) if len(top) else 0}


def trim(con: duckdb.DuckDBPyConnection, documents, sample_n: int) -> dict:
    """Cut a finished sample to its sample_n highest-priority rows per prototype. The sketch is nested, so these
    are exactly the rows a run with --band-sample-n sample_n gives, and the run is recorded as that run: a shipped
    database can hold a smaller sample without another pass over the corpus. `documents`: the corpus the run read,
    in its order (a row's priority needs its document's index)."""
    row = con.execute("SELECT args_json, status FROM runs WHERE job = ?", [NAME]).fetchone()
    if row is None or row[1] != "done":
        raise ValueError("the database has no finished bands job to trim")
    args = json.loads(row[0])
    if not 1 <= sample_n <= args["sample_n"]:
        raise ValueError(f"--sample-n must be between 1 and the sample's own {args['sample_n']}, got {sample_n}")
    limit = args.get("limit")
    index = {}
    for i, doc in enumerate(documents):
        if limit is not None and i >= limit:
            break
        index[doc.doc_id] = i
    rows = con.execute("SELECT prototype_id, rank, doc_id, token_position, activation FROM evidence_bands").fetch_df()
    missing = set(rows["doc_id"]) - set(index)
    if missing:
        raise ValueError(f"{len(missing)} sampled documents are not in this corpus (e.g. {sorted(missing)[0]!r}): "
                         "give the corpus the bands job read")
    rows["key"] = (rows["doc_id"].map(index).to_numpy(np.int64) << POSITION_BITS) | \
        rows["token_position"].to_numpy(np.int64)
    rows["score"] = priority(rows["prototype_id"].to_numpy(), rows["key"].to_numpy())
    rows = rows.sort_values(["prototype_id", "score", "key"], ascending=[True, False, True])
    kept = rows[rows.groupby("prototype_id").cumcount() < sample_n]
    kept = kept.sort_values(["prototype_id", "activation", "key"], ascending=[True, False, True])
    kept = kept.assign(new_rank=kept.groupby("prototype_id").cumcount().astype(np.int32))
    args["sample_n"] = sample_n
    args_json = canonical_args(args)
    with transaction(con):
        con.register("kept", kept[["prototype_id", "rank", "new_rank"]])
        con.execute("CREATE TEMP TABLE trimmed AS SELECT b.* REPLACE (k.new_rank AS rank) FROM evidence_bands b "
                    "JOIN kept k USING (prototype_id, rank)")
        con.unregister("kept")
        con.execute("DELETE FROM evidence_bands")
        con.execute("INSERT INTO evidence_bands SELECT * FROM trimmed")
        con.execute("DROP TABLE trimmed")
        con.execute("DELETE FROM band_documents WHERE doc_id NOT IN (SELECT DISTINCT doc_id FROM evidence_bands)")
        con.execute("UPDATE runs SET args_json = ?, run_id = ? WHERE job = ?",
                    [args_json, hashlib.sha256(f"{NAME}\n{args_json}".encode()).hexdigest()[:16], NAME])
    return {"sampled_rows": len(kept), "dropped_rows": len(rows) - len(kept), "sample_n": sample_n}


def trim_main(argv: list[str]) -> dict:
    parser = cli.parser("python -m precompute.bands trim", trim.__doc__)
    parser.add_argument("--db", required=True, help="the database whose bands sample to cut (changed in place)")
    parser.add_argument("--corpus", required=True, help="the corpus the bands job read (its documents' order)")
    parser.add_argument("--sample-n", type=int, required=True, help="rows to keep per prototype")
    ns = cli.parse(parser, argv)
    with cli.expected_errors(parser, ValueError, FileNotFoundError):
        documents, _ = load_corpus(ns.corpus)
        con = connect(Path(ns.db))
        try:
            summary = trim(con, documents, ns.sample_n)
        finally:
            con.close()
    cli.print_json(summary)
    return summary


def run_job(context: Context) -> dict | None:
    model, tokenizer, _ = context.inputs.model()
    documents, _ = context.inputs.corpus()
    return evidence.run(context.inputs.db, model, tokenizer, documents, context.args, context.inputs.identity(),
                        overwrite=context.overwrite, hooks=context.hooks, name=NAME, state_class=SampleState,
                        merge_fn=merge)


def add_sample_argument(parser) -> None:
    """--band-sample-n: the one flag of this job that `python -m precompute build` adds to the evidence job's."""
    cli.add_dataclass_arguments(parser, BandsArgs, names=["sample_n"], prefix="band_")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_input_arguments(parser)
    add_sample_argument(parser)
    cli.add_dataclass_arguments(parser, BandsArgs, names=[f for f in BandsArgs.__dataclass_fields__
                                                          if f != "sample_n"])


def bands_args(ns: argparse.Namespace) -> BandsArgs:
    """From the flags: --band-sample-n, and the window flags it shares with the evidence job."""
    return BandsArgs(sample_n=ns.band_sample_n, seq_len=ns.seq_len, batch_size=ns.batch_size,
                     context_before=ns.context_before, context_after=ns.context_after,
                     docs_per_chunk=ns.docs_per_chunk, limit=ns.limit)


JOB = Job(NAME, BandsArgs, run_job, args_from=bands_args, all_ranks=True)


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["trim"]:
        return trim_main(argv[1:])
    parser = cli.parser("python -m precompute.bands", __doc__)
    add_arguments(parser)
    return job_command(JOB, parser, argv)


if __name__ == "__main__":
    main()
