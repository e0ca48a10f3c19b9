"""The attribution job's command line (precompute/attribution/job.py).

    python -m precompute.attribution --model runs/prism/final --corpus default --db out.duckdb --max-sequences 4096
    python -m precompute build --model runs/prism/final --corpus default --db out.duckdb --jobs attribution
"""

from __future__ import annotations

import argparse

from precompute.attribution.job import JOB, add_arguments
from precompute.inputs import add_input_arguments, job_command
from prism import cli


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("python -m precompute.attribution", "The attribution job: cache per-training-sequence "
                        "statistics so a token's training data is a sparse product.")
    add_input_arguments(parser)
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> dict | None:
    return job_command(JOB, build_parser(), argv)


if __name__ == "__main__":
    main()
