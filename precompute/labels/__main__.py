"""The labels job's command line (precompute/labels/job.py).

    python -m precompute.labels --db out.duckdb
    python -m precompute.labels --db out.duckdb --labeler offline-v2   # v2 (the default is v3)
    python -m precompute.labels --db out.duckdb --labeler offline-v1
    python -m precompute.labels --db out.duckdb --labeler openai --endpoint http://127.0.0.1:8000/v1 --llm-model qwen
    python -m precompute.labels --db out.duckdb --labeler local --llm-model path/to/instruct-model

Prints how many rows were written and the category mix with both mean scores.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from precompute.inputs import Context, Inputs
from precompute.labels.job import JOB, LABELERS, N_NEGATIVES, LabelsArgs, category_mix
from precompute.labels.labeler import LabelerError
from precompute.runs import JobArgsMismatch, JobHooks, add_hook_argument
from prism import cli


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("python -m precompute.labels", "The labels job: a broad category, a topic, a two-sided label "
                        "and held-out scores for every prototype.")
    parser.add_argument("--db", required=True, help="the precompute DuckDB file (with the evidence job done)")
    # which labeler
    parser.add_argument("--labeler", choices=LABELERS, default="offline",
                        help="offline: v3, where it fires and what it pushes, with a topic "
                             "(precompute/labels/twosided.py); offline-v2: contrastive to the siblings (contrast.py); "
                             "offline-v1: token rules only")
    parser.add_argument("--endpoint", help="openai: the API root, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--llm-model", help="openai: the model name; local: the model folder")
    parser.add_argument("--api-key-env", default="OPENAI_API_KEY",
                        help="openai: environment variable holding the API key (the key is never stored)")
    parser.add_argument("--timeout", type=float, default=60.0, help="openai: seconds per request")
    # the job
    parser.add_argument("--seed", type=int, default=0, help="seed of the negative contexts for label_score")
    parser.add_argument("--n-negatives", type=int, default=N_NEGATIVES, help="random contexts scored against")
    parser.add_argument("--batch-size", type=int, default=64, help="prototypes per transaction")
    parser.add_argument("--overwrite", action="store_true", help="replace labels made with other arguments")
    add_hook_argument(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = cli.parse(parser, argv)
    with cli.expected_errors(parser, ValueError):  # the flags first: their errors need no database
        job_args = LabelsArgs(labeler=args.labeler, endpoint=args.endpoint, llm_model=args.llm_model,
                              api_key_env=args.api_key_env, timeout=args.timeout, seed=args.seed,
                              n_negatives=args.n_negatives, batch_size=args.batch_size)
    if not Path(args.db).is_file():
        cli.fail(parser, f"no database at {args.db}: run the evidence job first (python -m precompute build)")
    errors = (JobArgsMismatch, LabelerError, RuntimeError, ValueError, FileNotFoundError)
    with cli.expected_errors(parser, *errors), Inputs(args.db) as inputs:
        written = JOB.run(Context(inputs, job_args, args.overwrite, JobHooks.parse(args.hook)))
        mix = category_mix(inputs.connection())
    total = sum(row[1] for row in mix)
    print(f"labels: wrote {written} rows; {total} prototypes labelled")  # noqa: T201 - the command's output

    def shown(x) -> str:
        return f"{x:.3f}" if x is not None else "-"

    for category, n, score, sibling, d_rand, d_sib in mix:
        print(f"  {category:<24} {n:>6} {n / total:6.1%}  detection {shown(d_rand)} / {shown(d_sib)}  "  # noqa: T201
              f"label_score {shown(score)}  sibling_score {shown(sibling)}")
    return written


if __name__ == "__main__":
    main()
