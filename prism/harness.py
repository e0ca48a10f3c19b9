"""The lm-evaluation-harness command with PRISM registered, so `--model hf` can load a PRISM folder.

lm-eval loads `--model_args pretrained=FOLDER` through transformers' Auto classes, which know model_type "prism"
only once `prism` is imported. This module imports it and hands its command line to lm-eval unchanged (every
lm-eval option works, `run` is implied as with `lm-eval` itself):

    python -m prism.harness --model hf --model_args pretrained=assets/model,backend=causal --tasks arc_easy
    python -m prism.harness --model hf --model_args pretrained=assets/model --include_path my_tasks/ --tasks my_task

From Python, no wrapper is needed: `HFLM(pretrained=PrismForCausalLM.from_pretrained(folder), tokenizer=...)`.
"""

from __future__ import annotations

import sys

import prism  # noqa: F401 - registers model_type "prism" with transformers' Auto classes


def main(argv: list[str] | None = None) -> None:
    """Run lm-eval's command line (argv as after `lm-eval`; None reads sys.argv)."""
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    if argv is not None:
        sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved


if __name__ == "__main__":
    main()
