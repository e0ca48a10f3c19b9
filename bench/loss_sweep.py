"""Sweep the prototype losses' weights: train a PRISM point per (lambda_r1, lambda_r2[, k]) and one dense baseline on
the same data and steps, evaluate each on the same held-out tokens, and print a table of CE gap, coverage (R1_bar,
R2), FVE and dead share, with the point chosen against the goals.

    python -m bench.loss_sweep --out runs/sweep --r1 0.1,0.3,1 --r2 0.1,0.3,1 --max-val-tokens 32768 -- \
        --backbone smollm2 --corpus runs/default.jsonl --max-source-share 0.4 --max-tokens 310000 --mode top \
        --cache-layer 26 --cache-dir runs/cache26 --n-layers 2 --n-prototypes 1024 --top-k 8 --steps 147

Everything after `--` is prism.train's arguments shared by every point (give --cache-dir so the points share one
hidden-state cache; --cache-layer below the trained layers lets points with other --n-layers share it too). Each
point trains in OUT/<name> (prism.train resumes a stopped run with the same command, so the sweep resumes by running
it again), then is evaluated into OUT/<name>/eval.json (kept when made with the same --max-val-tokens). The dense
baseline (OUT/dense) is evaluated once; every point's CE gap is against it, on the same held-out blocks (checked).
The points differ only in the weights swept, so they see the same training tokens in the same order.

Goal (docs/DESIGN.md section 2): R1_bar >= 0.94 and R2 >= 0.94 with CE within 2% of dense. The chosen point is the
one meeting both with the smallest CE gap; if none does, the one with the highest min(R1_bar, R2) among those within
the CE bound, and the output says the goal was not met. Writes OUT/sweep.jsonl (one line per point) and prints
the table (markdown) and a JSON summary line.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from prism import cli

logger = logging.getLogger("bench.loss_sweep")

GOALS = {"coverage": 0.94, "ce_gap": 0.02}
# flags the sweep sets itself, so they must not also come through the shared prism.train arguments
OWN_FLAGS = ("--lambda-r1", "--lambda-r2", "--out", "--dense-baseline", "--overwrite")


def values(text: str, kind=float) -> list:
    """'0.1,0.3,1' -> [0.1, 0.3, 1.0]; a clear error for anything else."""
    try:
        out = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not out or any(v < 0 for v in out) or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"expected distinct non-negative numbers, got {text!r}")
    return out


def point_name(r1: float, r2: float, k: int | None) -> str:
    return f"r1-{r1:g}_r2-{r2:g}" + (f"_k{k}" if k is not None else "")


def _train(train_args: list[str], extra: list[str], out: Path) -> Path:
    from prism.train import main as train_main

    logger.info("training %s", out.name)
    return Path(train_main([*train_args, *extra, "--out", str(out)]))


def _evaluate(final: Path, out: Path, max_val_tokens: int | None, batch_size: int) -> dict:
    """prism.eval of one model into out (reused when made with the same settings)."""
    from prism.eval import main as eval_main

    settings = {"checkpoint": str(final), "max_val_tokens": max_val_tokens}
    if out.is_file():
        done = json.loads(out.read_text())
        if done.get("sweep_settings") == settings:
            return done
    argv = ["--checkpoint", str(final), "--no-backbone", "--batch-size", str(batch_size)]
    if max_val_tokens:
        argv += ["--max-val-tokens", str(max_val_tokens)]
    result = eval_main(argv)
    result["sweep_settings"] = settings
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(out)
    return result


def row(name: str, r1: float, r2: float, k: int, ev: dict, dense: dict) -> dict:
    p = ev["prism"]
    return {"point": name, "lambda_r1": r1, "lambda_r2": r2, "top_k": k, "ce": p["ce"], "dense_ce": dense["ce"],
            "ce_gap": p["ce"] / dense["ce"] - 1, "r1_bar": p["r1_bar"], "r2": p["r2"], "fve": p["fve"],
            "dead_fraction": p["dead_fraction"], "mean_active": p["mean_active"], "val_tokens": p["tokens"]}


def choose(rows: list[dict]) -> tuple[dict | None, bool]:
    """The point meeting every goal with the smallest CE gap, else the best-covered within the CE bound."""
    within = [r for r in rows if r["ce_gap"] <= GOALS["ce_gap"]]
    meets = [r for r in within if min(r["r1_bar"], r["r2"]) >= GOALS["coverage"]]
    if meets:
        return min(meets, key=lambda r: r["ce_gap"]), True
    if within:
        return max(within, key=lambda r: min(r["r1_bar"], r["r2"])), False
    return None, False


def table(rows: list[dict], chosen: dict | None) -> str:
    lines = ["| lambda_r1 | lambda_r2 | k | CE | CE vs dense | R1_bar | R2 | FVE | dead |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = "**" if chosen is not None and r["point"] == chosen["point"] else ""
        lines.append(f"| {mark}{r['lambda_r1']:g}{mark} | {r['lambda_r2']:g} | {r['top_k']} | {r['ce']:.4f} | "
                     f"{100 * r['ce_gap']:+.2f}% | {r['r1_bar']:.3f} | {r['r2']:.3f} | {r['fve']:.3f} | "
                     f"{100 * r['dead_fraction']:.1f}% |")
    return "\n".join(lines)


def run(args: argparse.Namespace, train_args: list[str]) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dense_final = _train(train_args, ["--dense-baseline"], out / "dense")
    dense_eval = _evaluate(dense_final, out / "dense" / "eval.json", args.max_val_tokens, args.batch_size)
    dense = {**dense_eval["dense"], "blocks": dense_eval["split"]["blocks"]}
    ks = args.top_k or [None]
    rows = []
    for k in ks:
        for r1 in args.r1:
            for r2 in args.r2:
                name = point_name(r1, r2, k if len(ks) > 1 else None)
                extra = ["--lambda-r1", str(r1), "--lambda-r2", str(r2)] + (["--top-k", str(k)] if k else [])
                final = _train(train_args, extra, out / name)
                ev = _evaluate(final, out / name / "eval.json", args.max_val_tokens, args.batch_size)
                if ev["split"]["blocks"] != dense["blocks"]:
                    raise ValueError(f"{name} was evaluated on {ev['split']['blocks']} held-out blocks, the dense "
                                     f"baseline on {dense['blocks']}: the points must share prism.train's data flags")
                top_k = json.loads((final / "config.json").read_text())["top_k"]
                rows.append(row(name, r1, r2, top_k, ev, dense))
                logger.info("%s", json.dumps(rows[-1]))
    with (out / "sweep.jsonl").open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    chosen, met = choose(rows)
    print(table(rows, chosen))  # noqa: T201 - the command's output
    return {"points": len(rows), "dense_ce": dense["ce"], "val_tokens": dense["tokens"],
            "chosen": chosen and chosen["point"], "goals_met": met, "goals": GOALS}


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("python -m bench.loss_sweep", __doc__)
    parser.add_argument("--out", required=True, help="sweep folder: one run folder per point, the dense baseline, "
                                                     "sweep.jsonl")
    parser.add_argument("--r1", type=values, default=[0.1, 0.3, 1.0], help="lambda_r1 values, comma-separated")
    parser.add_argument("--r2", type=values, default=[0.1, 0.3, 1.0], help="lambda_r2 values, comma-separated")
    parser.add_argument("--top-k", type=lambda t: values(t, int), default=None,
                        help="k values, comma-separated (default: prism.train's --top-k)")
    parser.add_argument("--max-val-tokens", type=int, default=32768, help="held-out tokens every model is scored on")
    parser.add_argument("--batch-size", type=int, default=8, help="evaluation batch size")
    parser.add_argument("train_args", nargs=argparse.REMAINDER,
                        help="after `--`: prism.train's arguments shared by every point")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = cli.parse(parser, argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if not train_args:
        cli.fail(parser, "give prism.train's shared arguments after `--` (at least --corpus)")
    clash = [f for f in OWN_FLAGS if f in train_args]
    if clash:
        cli.fail(parser, f"{', '.join(clash)} is set by the sweep itself; leave it out of the shared arguments")
    if args.max_val_tokens is not None and args.max_val_tokens < 1:
        cli.fail(parser, f"--max-val-tokens must be >= 1, got {args.max_val_tokens}")
    with cli.expected_errors(parser, ValueError, FileNotFoundError):
        result = run(args, train_args)
    cli.print_json(result)
    return result


if __name__ == "__main__":
    main()
