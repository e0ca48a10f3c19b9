"""The attribution job's command line (precompute/attribution/job.py).

    python -m precompute.attribution --model runs/prism/final --corpus default --db out.duckdb --max-sequences 4096
    python -m precompute build --model runs/prism/final --corpus default --db out.duckdb --jobs attribution
"""

from __future__ import annotations

import argparse

from precompute.attribution.job import JOB, add_arguments, attribution_args
from precompute.inputs import Context, Inputs
from prism import cli


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("python -m precompute.attribution", "The attribution job: cache per-training-sequence "
                        "statistics so a token's training data is a sparse product.")
    parser.add_argument("--model", required=True, help="a folder written by PrismForCausalLM.save_pretrained with its "
                                                       "tokenizer beside it, or 'default'")
    parser.add_argument("--corpus", required=True, help="a path, a hub dataset id (id[:config]) or 'default'")
    parser.add_argument("--db", required=True, help="the DuckDB file to write")
    parser.add_argument("--overwrite", action="store_true", help="replace results made with other arguments")
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> dict | None:
    parser = build_parser()
    ns = parser.parse_args(argv)
    cli.setup_logging()
    inputs = Inputs(ns.db, ns.model, ns.corpus)
    with cli.expected_errors(parser, ValueError, FileNotFoundError):
        args = attribution_args(ns)
        inputs.model()
        inputs.corpus()
    try:
        return JOB.run(Context(inputs, args, ns.overwrite))
    finally:
        inputs.close()


if __name__ == "__main__":
    main()
