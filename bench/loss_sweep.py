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

Named points instead of the grid (the prototypes-carry sweep): --point NAME=FLAGS, repeated, where FLAGS are
prism.train flags that override the shared ones for that point, e.g.

    python -m bench.loss_sweep --out runs/sweep3 --point base= --point kl1="--lambda-path-kl 1" \
        --point k32="--n-prototypes 4096 --top-k 32 --lambda-path-kl 1" --point l4="--n-layers 4" -- $COMMON

Each point's dense baseline is trained with the shared flags plus the point's flags that a dense model has (not
the bank's: --n-prototypes, --top-k, --lambda-*, --prototype-lr, --init-*, --dead-every), so a 4-layer point is
compared with a 4-layer dense model; points whose dense flags agree share one baseline (OUT/dense, or
OUT/dense_<flags>). Rows then also hold what the prototypes carry (prism.eval's path measures: agreement,
margin share, path CE, KL; overall, the worst source and the probe) and training tokens/s against dense.

Goal (docs/DESIGN.md section 2): R1_bar >= 0.94 and R2 >= 0.94 with CE within 2% of dense. The chosen point is the
one meeting both with the smallest CE gap; if none does, the one with the highest min(R1_bar, R2) among those within
the CE bound, and the output says the goal was not met. Writes OUT/sweep.jsonl (one line per point) and prints
the table (markdown) and a JSON summary line.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shlex
import statistics
from pathlib import Path

from prism import cli

logger = logging.getLogger("bench.loss_sweep")

GOALS = {"coverage": 0.94, "ce_gap": 0.02}
# the prototypes-carry goals (issue 35): on held-out tokens of every source and on the probe
PATH_GOALS = {"agreement": 0.70, "margin_share": 0.60, "coverage": 0.94, "ce_gap": 0.03}
# flags the sweep sets itself, so they must not also come through the shared prism.train arguments
OWN_FLAGS = ("--lambda-r1", "--lambda-r2", "--out", "--dense-baseline", "--overwrite")
POINT_OWN_FLAGS = ("--out", "--dense-baseline", "--overwrite")  # with --point the weights are the points' to set
# prism.train flags that only the bank has (each takes a value): a point's dense baseline leaves them out
PROTOTYPE_ONLY = ("--n-prototypes", "--top-k", "--lambda-rec", "--lambda-r1", "--lambda-r2", "--lambda-path-ce",
                  "--lambda-path-kl", "--lambda-head-rec", "--prototype-lr", "--init-tokens", "--init-balance",
                  "--dead-every")
# bump when prism.eval's output gains measures the rows read, so older eval.json files are made again
EVAL_VERSION = 2


def values(text: str, kind=float) -> list:
    """'0.1,0.3,1' -> [0.1, 0.3, 1.0]; a clear error for anything else."""
    try:
        out = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not out or any(v < 0 for v in out) or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"expected distinct non-negative numbers, got {text!r}")
    return out


def parse_point(text: str) -> tuple[str, list[str]]:
    """'NAME=FLAGS' -> (NAME, [flags]); NAME of letters, digits, '.', '_', '-'; FLAGS may be empty."""
    name, sep, flags = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name) or name.startswith("dense"):
        raise argparse.ArgumentTypeError(f"expected NAME=FLAGS with NAME of letters, digits, '.', '_' or '-' (not "
                                         f"starting with 'dense'), got {text!r}")
    try:
        argv = shlex.split(flags)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"point {name}: {e}") from None
    clash = [f for f in argv if f.split("=")[0] in POINT_OWN_FLAGS]
    if clash:
        raise argparse.ArgumentTypeError(f"point {name}: {', '.join(clash)} is set by the sweep itself")
    return name, argv


def dense_flags(flags: list[str]) -> list[str]:
    """The point's flags that a dense model has: the bank's flags (PROTOTYPE_ONLY) and their values dropped."""
    out, i = [], 0
    while i < len(flags):
        flag = flags[i]
        if flag.split("=")[0] in PROTOTYPE_ONLY:
            i += 1 if "=" in flag else 2
            continue
        out.append(flag)
        i += 1
    return out


def dense_folder(flags: list[str]) -> str:
    return "dense" if not flags else "dense_" + re.sub(r"[^A-Za-z0-9.]+", "-", " ".join(flags)).strip("-")


def tokens_per_s(run: Path) -> float | None:
    """Median training tokens/s of a run's log (prism.train's train_log.jsonl), None without one."""
    log = run / "train_log.jsonl"
    if not log.is_file():
        return None
    speeds = [row["tokens_per_s"] for row in map(json.loads, log.read_text().splitlines()) if "tokens_per_s" in row]
    return statistics.median(speeds) if speeds else None


def point_name(r1: float, r2: float, k: int | None) -> str:
    return f"r1-{r1:g}_r2-{r2:g}" + (f"_k{k}" if k is not None else "")


def _train(train_args: list[str], extra: list[str], out: Path) -> Path:
    from prism.train import main as train_main

    logger.info("training %s", out.name)
    return Path(train_main([*train_args, *extra, "--out", str(out)]))


def _evaluate(final: Path, out: Path, max_val_tokens: int | None, batch_size: int,
              per_source_tokens: int = 0) -> dict:
    """prism.eval of one model into out (reused when made with the same settings)."""
    from prism.eval import main as eval_main

    settings = {"checkpoint": str(final), "max_val_tokens": max_val_tokens, "per_source_tokens": per_source_tokens,
                "eval_version": EVAL_VERSION}
    if out.is_file():
        done = json.loads(out.read_text())
        if done.get("sweep_settings") == settings:
            return done
    argv = ["--checkpoint", str(final), "--no-backbone", "--batch-size", str(batch_size),
            "--per-source-tokens", str(per_source_tokens)]
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


def path_row(name: str, flags: list[str], final: Path, ev: dict, dense: dict) -> dict:
    """One named point: its configuration, CE against its dense baseline, coverage, what the prototypes carry
    (overall, the worst source, the probe) and its training speed against the dense run's."""
    p = ev["prism"]
    config = json.loads((final / "config.json").read_text())
    trained = json.loads((final.parent / "train_args.json").read_text())
    sources = p.get("sources") or {}
    worst = min(sources, key=lambda src: sources[src]["agreement"]) if sources else None
    probe = p.get("probe") or {}
    speed = tokens_per_s(final.parent)
    row = {"point": name, "flags": shlex.join(flags), "n_prototypes": config["n_prototypes"],
           "top_k": config["top_k"], "n_layers": trained["n_layers"],
           **{k: config.get(k, 0.0) for k in ("lambda_rec", "lambda_r1", "lambda_r2", "lambda_path_ce",
                                              "lambda_path_kl", "lambda_head_rec")},
           "ce": p["ce"], "dense_ce": dense["ce"], "ce_gap": p["ce"] / dense["ce"] - 1, "r1_bar": p["r1_bar"],
           "r2": p["r2"], "fve": p["fve"], "dead_fraction": p["dead_fraction"], "val_tokens": p["tokens"],
           "agreement": p["path"]["agreement"], "margin_share": p["path"]["margin_share_median"],
           "carried_fraction": p["path"]["carried_fraction"], "path_ce": p["path"]["path_ce"],
           "kl": p["path"]["kl"], "worst_source": worst,
           "worst_source_agreement": sources[worst]["agreement"] if worst else None,
           "min_source_margin_share": min(v["margin_share_median"] for v in sources.values()) if sources else None,
           "probe_agreement": probe.get("agreement"), "probe_margin_share": probe.get("margin_share_median"),
           "tokens_per_s": speed, "dense_tokens_per_s": dense.get("tokens_per_s")}
    row["speed_vs_dense"] = speed / row["dense_tokens_per_s"] if speed and row["dense_tokens_per_s"] else None
    return row


def _lowest(row: dict, names: tuple[str, ...]) -> float:
    return min(row[n] for n in names if row.get(n) is not None)


def path_goal_values(row: dict) -> tuple[float, float]:
    """(agreement, margin share) a point reaches everywhere it is measured: the lowest of overall, worst source
    and probe."""
    return (_lowest(row, ("agreement", "worst_source_agreement", "probe_agreement")),
            _lowest(row, ("margin_share", "min_source_margin_share", "probe_margin_share")))


def choose_path(rows: list[dict]) -> tuple[dict | None, bool]:
    """The point meeting every PATH_GOAL with the smallest CE gap, else the one carrying the most (the lowest
    agreement everywhere, then the lowest share) within the CE bound."""
    within = [r for r in rows if r["ce_gap"] <= PATH_GOALS["ce_gap"]]
    meets = [r for r in within if min(r["r1_bar"], r["r2"]) >= PATH_GOALS["coverage"]
             and path_goal_values(r)[0] >= PATH_GOALS["agreement"]
             and path_goal_values(r)[1] >= PATH_GOALS["margin_share"]]
    if meets:
        return min(meets, key=lambda r: r["ce_gap"]), True
    if within:
        return max(within, key=path_goal_values), False
    return None, False


def _fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def path_table(rows: list[dict], chosen: dict | None) -> str:
    lines = ["| point | K | k | layers | CE vs dense | R1_bar | R2 | agreement (all / worst source / probe) | "
             "margin share (all / worst source / probe) | share >= 0.5 | path CE | tokens/s vs dense |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = "**" if chosen is not None and r["point"] == chosen["point"] else ""
        lines.append(f"| {mark}{r['point']}{mark} | {r['n_prototypes']} | {r['top_k']} | {r['n_layers']} | "
                     f"{100 * r['ce_gap']:+.2f}% | {r['r1_bar']:.3f} | {r['r2']:.3f} | "
                     f"{r['agreement']:.3f} / {_fmt(r['worst_source_agreement'])} / {_fmt(r['probe_agreement'])} | "
                     f"{r['margin_share']:.3f} / {_fmt(r['min_source_margin_share'])} / "
                     f"{_fmt(r['probe_margin_share'])} | {r['carried_fraction']:.3f} | {r['path_ce']:.3f} | "
                     f"{_fmt(r['speed_vs_dense'], '.2f')} |")
    return "\n".join(lines)


def path_figure(rows: list[dict]):
    """Agreement and margin share (the lowest of overall, worst source and probe) against the CE gap, one curve
    per bank size K."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("top-1 agreement of W z_hat + b with the model",
                                                        "median margin share of the prototypes"))
    palette = ("#4e79a7", "#e15759", "#59a14f", "#b07aa1", "#f28e2b")
    for i, n_protos in enumerate(sorted({r["n_prototypes"] for r in rows})):
        group = sorted((r for r in rows if r["n_prototypes"] == n_protos), key=lambda r: r["ce_gap"])
        x = [100 * r["ce_gap"] for r in group]
        text = [r["point"] for r in group]
        for col, index in ((1, 0), (2, 1)):
            fig.add_trace(go.Scatter(x=x, y=[path_goal_values(r)[index] for r in group], text=text,
                                     mode="lines+markers+text", name=f"K = {n_protos}",
                                     textposition=[("top center", "bottom center")[j % 2] for j in range(len(group))],
                                     textfont=dict(size=10),
                                     line=dict(color=palette[i % len(palette)]),
                                     legendgroup=str(n_protos), showlegend=col == 1), row=1, col=col)
    for col, goal in ((1, PATH_GOALS["agreement"]), (2, PATH_GOALS["margin_share"])):
        fig.add_hline(y=goal, line_dash="dash", line_color="grey", row=1, col=col)
        fig.add_vline(x=100 * PATH_GOALS["ce_gap"], line_dash="dot", line_color="grey", row=1, col=col)
        fig.update_xaxes(title_text="CE vs dense (%)", row=1, col=col)
    fig.update_layout(width=1200, height=520, template="plotly_white",
                      title="What the prototypes carry against what they cost (lowest of held-out, worst source, "
                            "probe; dashed: goal)")
    return fig


def path_bars(rows: list[dict]):
    """Agreement and margin share of each point, held-out / worst source / probe as grouped bars (the points in
    the order they ran, each named with its CE gap), the goals dashed."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=("top-1 agreement of W z_hat + b with the model",
                                        "median margin share of the prototypes"))
    names = [f"{r['point']} ({100 * r['ce_gap']:+.2f}% CE)" for r in rows]
    measures = (("held-out", "agreement", "margin_share", "#4e79a7"),
                ("worst source", "worst_source_agreement", "min_source_margin_share", "#f28e2b"),
                ("probe", "probe_agreement", "probe_margin_share", "#59a14f"))
    for label, agree, share, colour in measures:
        for col, key in ((1, agree), (2, share)):
            fig.add_trace(go.Bar(y=names, x=[r.get(key) for r in rows], orientation="h", name=label,
                                 marker_color=colour, legendgroup=label, showlegend=col == 1), row=1, col=col)
    for col, goal, keys in ((1, PATH_GOALS["agreement"], [m[1] for m in measures]),
                            (2, PATH_GOALS["margin_share"], [m[2] for m in measures])):
        top = max([goal, *(r[k] for r in rows for k in keys if r.get(k) is not None)])
        fig.add_vline(x=goal, line_dash="dash", line_color="grey", row=1, col=col)
        fig.update_xaxes(range=[min(0.0, *(r[k] for r in rows for k in keys if r.get(k) is not None)), 1.05 * top],
                         row=1, col=col)
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(width=1200, height=160 + 60 * len(rows), template="plotly_white", barmode="group",
                      title="What the prototypes carry, held-out / worst source / probe (dashed: goal)")
    return fig


def run_points(args: argparse.Namespace, train_args: list[str]) -> dict:
    """The named points (--point), each against the dense baseline with its own dense flags."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dense_runs: dict[str, dict] = {}
    rows = []
    for name, flags in args.point:
        dflags = dense_flags(flags)
        folder = dense_folder(dflags)
        if folder not in dense_runs:
            final = _train(train_args, [*dflags, "--dense-baseline"], out / folder)
            ev = _evaluate(final, out / folder / "eval.json", args.max_val_tokens, args.batch_size)
            dense_runs[folder] = {**ev["dense"], "blocks": ev["split"]["blocks"],
                                  "tokens_per_s": tokens_per_s(out / folder)}
        dense = dense_runs[folder]
        final = _train(train_args, flags, out / name)
        ev = _evaluate(final, out / name / "eval.json", args.max_val_tokens, args.batch_size, args.per_source_tokens)
        if ev["split"]["blocks"] != dense["blocks"]:
            raise ValueError(f"{name} was evaluated on {ev['split']['blocks']} held-out blocks, its dense baseline "
                             f"on {dense['blocks']}: the points must share prism.train's data flags")
        rows.append(path_row(name, flags, final, ev, dense))
        logger.info("%s", json.dumps(rows[-1]))
    with (out / "sweep.jsonl").open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    chosen, met = choose_path(rows)
    print(path_table(rows, chosen))  # noqa: T201 - the command's output
    if args.plot:
        from bench.attribution_scaling import write_png

        plot = Path(args.plot)
        write_png(path_figure(rows), plot)
        write_png(path_bars(rows), plot.with_name(plot.stem + "_points" + plot.suffix))
    return {"points": len(rows), "dense": {k: v["ce"] for k, v in dense_runs.items()},
            "chosen": chosen and chosen["point"], "goals_met": met, "goals": PATH_GOALS}


def run(args: argparse.Namespace, train_args: list[str]) -> dict:
    if args.point:
        return run_points(args, train_args)
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
    parser.add_argument("--point", type=parse_point, action="append", default=[],
                        help="NAME=FLAGS, repeated: a named point whose prism.train flags override the shared ones "
                             "(instead of the --r1/--r2/--top-k grid); see the module docstring")
    parser.add_argument("--per-source-tokens", type=int, default=8192,
                        help="with --point: prism.eval's path measures on this many held-out tokens a source")
    parser.add_argument("--plot", help="with --point: write agreement and margin share against the CE gap, one curve "
                                       "per bank size, as PNG, and each point's held-out / worst source / probe "
                                       "values beside it as NAME_points.png (Debian chromium)")
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
    names = [name for name, _ in args.point]
    if len(set(names)) != len(names):
        cli.fail(parser, f"point names must be distinct, got {', '.join(names)}")
    clash = [f for f in (POINT_OWN_FLAGS if args.point else OWN_FLAGS) if f in train_args]
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
