"""Build a precompute database: evidence, labels, search embeddings, the prototype map and intervention presets,
in that order.

    python -m precompute build --model runs/prism/final --corpus default --db out.duckdb
    python -m precompute build ... --jobs evidence,labels           # a subset (later jobs read earlier ones)
    python -m precompute build ... --jobs attribution --attribution-max-sequences 4096   # opt-in: training data
    torchrun --standalone --nproc-per-node 2 -m precompute build ...  # evidence sharded by rank, merged by rank 0
    python -m precompute strip-text --db out.duckdb --out shipped.duckdb   # pointer-only copy for shipping

Every job stores its arguments in the database; running it again with the same arguments does nothing, with
other arguments it is refused unless --overwrite. A killed build resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch.distributed as dist

from precompute import attribution, evidence
from precompute.inputs import load_corpus, load_model, setup_distributed
from precompute.runs import JobArgsMismatch, connect
from precompute.schema import DEFAULT_JOBS, JOBS
from precompute.ship import strip_text

logger = logging.getLogger("precompute")


def build(ns: argparse.Namespace) -> dict:
    jobs = [j.strip() for j in ns.jobs.split(",") if j.strip()]
    unknown = [j for j in jobs if j not in JOBS]
    if unknown:
        raise ValueError(f"unknown jobs {unknown}; jobs are {', '.join(JOBS)}")
    model, tokenizer, model_info = load_model(ns.model)
    documents, corpus_info = load_corpus(ns.corpus)
    summary: dict = {}
    setup_distributed()
    rank = dist.get_rank() if dist.is_initialized() else 0
    if "evidence" in jobs:
        summary["evidence"] = evidence.run(ns.db, model, tokenizer, documents, evidence.evidence_args(ns),
                                           {"model": model_info, "corpus": corpus_info}, overwrite=ns.overwrite)
    if dist.is_initialized():
        dist.barrier()
    if rank != 0:
        return summary
    if "attribution" in jobs:
        summary["attribution"] = attribution.run(ns.db, model, tokenizer, documents, attribution.attribution_args(ns),
                                                 {"model": model_info, "corpus": corpus_info}, overwrite=ns.overwrite)
    con = connect(ns.db)
    try:
        if "labels" in jobs:
            from precompute import labels

            summary["labels"] = labels.run(con, labels.make_labeler(ns.labeler, endpoint=ns.endpoint,
                                                                    model=ns.llm_model), overwrite=ns.overwrite,
                                         seed=ns.seed)
        if "search" in jobs:
            from precompute import search

            summary["search"] = search.run(con, overwrite=ns.overwrite)
        if "map" in jobs:
            from precompute import map as proto_map

            vectors = model.prototypes.weight.detach().float().numpy()
            summary["map"] = proto_map.run(con, vectors, seed=ns.seed, overwrite=ns.overwrite)
        if "presets" in jobs:
            from precompute import presets

            summary["presets"] = presets.run(con, presets.PresetArgs(), overwrite=ns.overwrite)
    finally:
        con.close()
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m precompute", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="run the jobs into a database",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    evidence.add_arguments(b)
    b.add_argument("--jobs", default=",".join(DEFAULT_JOBS),
                   help=f"comma-separated subset of {', '.join(JOBS)} (attribution only when named)")
    attribution.add_arguments(b.add_argument_group("attribution"), shared=True)
    b.add_argument("--labeler", default="offline", choices=("offline", "offline-v1", "openai", "local"),
                   help="offline: labeler v2 (against siblings); offline-v1: the first, token-rule labeler")
    b.add_argument("--endpoint", default=None, help="OpenAI-compatible base URL for --labeler openai")
    b.add_argument("--llm-model", default=None, help="model name (openai) or local folder (local)")
    b.add_argument("--seed", type=int, default=0, help="seed of the map layout and label scores")
    s = sub.add_parser("strip-text", help="write a pointer-only copy of a database (no third-party text)")
    s.add_argument("--db", required=True)
    s.add_argument("--out", required=True)
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if ns.command == "strip-text":
            result = strip_text(Path(ns.db), Path(ns.out))
        else:
            result = build(ns)
    except (ValueError, FileNotFoundError, FileExistsError, JobArgsMismatch) as err:
        parser.error(str(err))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    json.dump(result, sys.stdout, default=str)
    sys.stdout.write("\n")
    return result


if __name__ == "__main__":
    main()
