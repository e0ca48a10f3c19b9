"""Build a precompute database: evidence, its activation bands, labels, search embeddings, the prototype map and
intervention presets, in that order.

    python -m precompute build --model runs/prism/final --corpus default --db out.duckdb
    python -m precompute build ... --jobs evidence,labels           # a subset (later jobs read earlier ones)
    python -m precompute build ... --jobs attribution --attribution-max-sequences 4096   # opt-in: training data
    torchrun --standalone --nproc-per-node 2 -m precompute build ...  # evidence sharded by rank, merged by rank 0
    python -m precompute strip-text --db out.duckdb --out shipped.duckdb   # pointer-only copy for shipping

Every job stores its arguments in the database; running it again with the same arguments does nothing, with
other arguments it is refused unless --overwrite. A killed build resumes where it stopped.

This module is the command line only: the jobs are precompute/jobs.py's registry (each a name, an arguments dataclass
and run(context)), their shared inputs precompute/inputs.py; build() loops over the registry.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch.distributed as dist

from precompute import attribution, bands, evidence
from precompute.inputs import Context, Inputs, rank_and_world, setup_distributed
from precompute.jobs import REGISTRY
from precompute.labels import LABELERS
from precompute.runs import JobArgsMismatch, JobHooks, add_hook_argument
from precompute.schema import DEFAULT_JOBS, JOBS
from precompute.ship import strip_text
from prism import cli

logger = logging.getLogger("precompute")


def build(ns: argparse.Namespace) -> dict:
    """Run the jobs --jobs names, in registry order, with one set of inputs: the all-ranks jobs (evidence) on every
    rank, then, once every rank finished them, the others on rank 0."""
    names = [j.strip() for j in ns.jobs.split(",") if j.strip()]
    unknown = [j for j in names if j not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown jobs {unknown}; jobs are {', '.join(JOBS)}")
    jobs = [job for job in REGISTRY.values() if job.name in names]
    args = {job.name: job.args_from(ns) for job in jobs}  # every job's arguments are checked before any job runs
    hooks = JobHooks.parse(ns.hook)
    summary: dict = {}
    with Inputs(ns.db, ns.model, ns.corpus) as inputs:
        inputs.model()  # a bad --model or --corpus fails here, before any job runs
        inputs.corpus()
        setup_distributed()
        rank, _ = rank_and_world()
        for job in jobs:
            if job.all_ranks:
                summary[job.name] = job.run(Context(inputs, args[job.name], ns.overwrite, hooks))
        if dist.is_initialized():
            dist.barrier()
        if rank != 0:
            return summary
        for job in jobs:
            if not job.all_ranks:
                summary[job.name] = job.run(Context(inputs, args[job.name], ns.overwrite, hooks))
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("python -m precompute", __doc__, formatter="raw", epilog=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    b = cli.subparser(sub, "build", help="run the jobs into a database")
    evidence.add_arguments(b)
    bands.add_sample_argument(b)
    b.add_argument("--jobs", default=",".join(DEFAULT_JOBS),
                   help=f"comma-separated subset of {', '.join(JOBS)} (attribution only when named)")
    attribution.add_arguments(b.add_argument_group("attribution"), shared=True)
    b.add_argument("--labeler", default="offline", choices=LABELERS,
                   help="offline: labeler v2 (against siblings); offline-v1: the first, token-rule labeler")
    b.add_argument("--endpoint", default=None, help="OpenAI-compatible base URL for --labeler openai")
    b.add_argument("--llm-model", default=None, help="model name (openai) or local folder (local)")
    b.add_argument("--seed", type=int, default=0, help="seed of the map layout and label scores")
    add_hook_argument(b)
    s = sub.add_parser("strip-text", help="write a pointer-only copy of a database (no third-party text)")
    s.add_argument("--db", required=True, help="the database to copy (left as it is)")
    s.add_argument("--out", required=True, help="the pointer-only copy to write")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    ns = cli.parse(parser, argv)
    try:
        with cli.expected_errors(parser, ValueError, FileNotFoundError, FileExistsError, JobArgsMismatch):
            result = strip_text(Path(ns.db), Path(ns.out)) if ns.command == "strip-text" else build(ns)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    cli.print_json(result)
    return result


if __name__ == "__main__":
    main()
