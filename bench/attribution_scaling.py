"""How attribution's cost grows with the training set: bench.attribution at several sizes, one JSON line per size,
power laws fitted per level, and a log-log plot (docs/images/attribution_scaling.png).

    python -m bench.attribution_scaling --model assets/model --base-db assets/prism-default.duckdb --corpus default \
        --sizes 768,1536,3072,12288,24576 --ekfac-max 3072 --out runs/attr-scaling \
        --plot docs/images/attribution_scaling.png

Per size n: a copy of --base-db with an attribution cache over the first n training windows (OUT/n<n>.duckdb), and
bench.attribution's levels on it (cached and reference always, EK-FAC where n <= --ekfac-max), each in its own
process with its own peak RSS (the cached level memory-maps its index, as the app does); the JSON line goes to
OUT/scaling.jsonl (a rerun replaces the line of its size).
Everything resumes: the cache job resumes a killed build, bench.attribution --resume keeps prepared inputs and
finished levels, so running the same command again after a stopped session goes on where it stopped.

Where EK-FAC did not run, its per-query cost is extrapolated from the sizes where it did: a line a + b n fitted to
its measured per-query times (every query batch is one pass over the n training sequences), reported as
ekfac_query_ms_extrapolated and speedup_extrapolated, never under the measured names. The goal (issue 19) is read
at the largest size where EK-FAC ran end to end.

Per level the fitted power law t = c n^p (least squares in log-log) is printed with the plot; p near 1 means cost
proportional to the training set, near 0 independent of it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from prism import cli

logger = logging.getLogger("bench.attribution_scaling")

ROOT = Path(__file__).resolve().parents[1]
GOAL_SPEEDUP = 470.0


def sizes(text: str) -> list[int]:
    try:
        out = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not out or out[0] < 1:
        raise argparse.ArgumentTypeError(f"sizes must be >= 1, got {text!r}")
    return out


def machine_label() -> str:
    """This machine in a few words: CPU model, threads and vector extensions (bench.train_throughput.machine)."""
    from bench.train_throughput import machine

    m = machine()
    return f"{m['cpu']}, {m['threads']} threads" + (f", {' '.join(m['extensions'])}" if m["extensions"] else "")


def run_of(line: dict) -> str:
    """Which day and machine a record was measured on: its own marker and fitted line in the figure."""
    return ", ".join(x for x in (line.get("measured_on"), line.get("machine")) if x)


def per_query_ms(line: dict) -> dict[str, float]:
    """Milliseconds per query of each level that ran at this size (the reference scores all queries in one pass)."""
    out = {}
    if line.get("cached_query_ms") is not None:
        out["cached"] = line["cached_query_ms"]
    if line.get("ekfac_query_ms") is not None:
        out["ekfac"] = line["ekfac_query_ms"]
    if line.get("reference_s") is not None:
        out["reference"] = 1e3 * line["reference_s"] / line["n_queries"]
    return out


def power_law(n: list[float], t: list[float]) -> tuple[float, float] | None:
    """(c, p) of t = c n^p by least squares on the logs; None with fewer than two sizes."""
    if len(n) < 2:
        return None
    p, log_c = np.polyfit(np.log(n), np.log(t), 1)
    return float(np.exp(log_c)), float(p)


def extrapolate(lines: list[dict]) -> list[dict]:
    """Add ekfac_query_ms_extrapolated (a + b n through the measured sizes) and speedup_extrapolated where EK-FAC
    did not run."""
    measured = [(line["n_train"], line["ekfac_query_ms"]) for line in lines if line.get("ekfac_query_ms") is not None]
    if not measured:
        return lines
    n, t = np.array([m[0] for m in measured], float), np.array([m[1] for m in measured], float)
    b, a = np.polyfit(n, t, 1) if len(n) > 1 else (t[0] / n[0], 0.0)
    for line in lines:
        if line.get("ekfac_query_ms") is None and line.get("cached_query_ms"):
            line["ekfac_query_ms_extrapolated"] = float(a + b * line["n_train"])
            line["ekfac_extrapolated_from"] = [int(x) for x in n]
            line["speedup_extrapolated"] = line["ekfac_query_ms_extrapolated"] / line["cached_query_ms"]
            if line.get("cached_click_ms"):
                line["speedup_click_extrapolated"] = line["ekfac_query_ms_extrapolated"] / line["cached_click_ms"]
    return lines


def summary(lines: list[dict]) -> dict:
    fits = {}
    for level in ("cached", "ekfac", "reference"):
        points = [(line["n_train"], per_query_ms(line)[level]) for line in lines if level in per_query_ms(line)]
        fit = power_law([p[0] for p in points], [p[1] for p in points])
        if fit:
            fits[level] = {"c_ms": fit[0], "exponent": fit[1], "sizes": [p[0] for p in points]}
    ran = [line for line in lines if line.get("speedup") is not None]
    largest = max(ran, key=lambda line: line["n_train"]) if ran else None
    return {"sizes": [line["n_train"] for line in lines], "fits": fits,
            "speedup_at_largest_ekfac_size": largest and largest["speedup"],
            "largest_ekfac_size": largest and largest["n_train"],
            "top10_overlap_min": min((line["top10_overlap"] for line in lines if "top10_overlap" in line),
                                     default=None),
            "goals_met": largest is not None and {
                "speedup": largest["speedup"] >= GOAL_SPEEDUP,
                "top10_overlap": all(line.get("top10_overlap", 0) >= 0.80 for line in lines),
                "memory": all(line.get("memory_ratio", 0) <= 1.0 for line in ran)}}


def figure(lines: list[dict], fits: dict):
    import plotly.graph_objects as go

    colours = {"cached": "#1f77b4", "ekfac": "#d62728", "reference": "#2ca02c"}
    names = {"cached": "cached (prototype space)", "ekfac": "EK-FAC (kronfluence)", "reference": "reference"}
    fig = go.Figure()
    dates = sorted({run_of(line) for line in lines})
    for level in ("cached", "ekfac", "reference"):
        points = [(line["n_train"], per_query_ms(line)[level]) for line in lines if level in per_query_ms(line)]
        if not points:
            continue
        for date in dates:  # sizes measured on another day (another machine) get their own marker
            here = [(line["n_train"], per_query_ms(line)[level]) for line in lines
                    if level in per_query_ms(line) and run_of(line) == date]
            if here:
                fig.add_trace(go.Scatter(
                    x=[p[0] for p in here], y=[p[1] / 1e3 for p in here], mode="markers",
                    marker={"color": colours[level], "size": 10,
                            "symbol": "circle" if date == dates[-1] else "diamond"},
                    name=names[level] + (f" ({date})" if len(dates) > 1 else "")))
        # one fitted line per day the level was measured on (one machine, one version of the code each)
        groups = {date: [(line["n_train"], per_query_ms(line)[level]) for line in lines
                         if level in per_query_ms(line) and run_of(line) == date] for date in dates}
        for date, here in groups.items():
            fit = (fits[level]["c_ms"], fits[level]["exponent"]) if len(dates) == 1 and level in fits else \
                power_law([pt[0] for pt in here], [pt[1] for pt in here])
            if fit is None:
                continue
            c, p = fit
            xs = np.geomspace(min(pt[0] for pt in here), max(line["n_train"] for line in lines), 50)
            fig.add_trace(go.Scatter(x=xs, y=c * xs ** p / 1e3, mode="lines",
                                     name=f"fit{f' ({date})' if len(dates) > 1 else ''}: n^{p:.2f}",
                                     line={"color": colours[level], "dash": "solid" if date == dates[-1] else "dot"}))
    extra = [line for line in lines if line.get("ekfac_query_ms_extrapolated") is not None]
    if extra:
        fig.add_trace(go.Scatter(x=[line["n_train"] for line in extra],
                                 y=[line["ekfac_query_ms_extrapolated"] / 1e3 for line in extra], mode="markers",
                                 marker={"color": colours["ekfac"], "size": 10, "symbol": "circle-open"},
                                 name="EK-FAC, extrapolated (a + b n)"))
    fig.update_xaxes(type="log", title="training sequences")
    fig.update_yaxes(type="log", title="seconds per query")
    fig.update_layout(width=1100, height=560, template="plotly_white", title="Attribution: cost per query against "
                      "training-set size (2 CPU cores)", legend={"x": 1.02, "y": 1.0})
    return fig


def write_png(fig, out: Path) -> None:
    """The figure as PNG through Debian's chromium (plotly has no image export without kaleido)."""
    from playwright.sync_api import sync_playwright

    from tools.screenshots import CHROMIUM, CHROMIUM_ARGS

    out.parent.mkdir(parents=True, exist_ok=True)
    html = out.with_suffix(".html")
    fig.write_html(html, include_plotlyjs=True, full_html=True, config={"staticPlot": True})
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": fig.layout.width + 20, "height": fig.layout.height + 20})
            page.goto(html.resolve().as_uri())
            page.wait_for_selector(".main-svg")
            page.locator(".plotly-graph-div").screenshot(path=str(out))
            browser.close()
    finally:
        html.unlink(missing_ok=True)


def _read_lines(path: Path) -> dict[int, dict]:
    if not path.is_file():
        return {}
    return {json.loads(t)["n_train"]: json.loads(t) for t in path.read_text().splitlines() if t.strip()}


def run_size(args: argparse.Namespace, n: int) -> dict:
    out = Path(args.out)
    db = out / f"n{n}.duckdb"
    if not db.exists():
        shutil.copy(args.base_db, db)
    levels = "cached,reference" + (",ekfac" if n <= args.ekfac_max else "")
    argv = [sys.executable, "-m", "bench.attribution", "--model", args.model, "--db", str(db), "--corpus",
            args.corpus, "--n-train", str(n), "--seq-len", str(args.seq_len), "--n-queries", str(args.n_queries),
            "--levels", levels, "--work", str(out / f"n{n}.work"), "--resume", "--keep-work", "--seed",
            str(args.seed), "--mmap"]
    if args.ekfac_queries:
        argv += ["--ekfac-queries", str(args.ekfac_queries)]
    argv += args.bench_args
    logger.info("size %d: %s", n, " ".join(argv[1:]))
    proc = subprocess.run(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench.attribution failed at {n} sequences (exit code {proc.returncode}); run the same "
                           "command again to resume")
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    line["measured_on"] = datetime.date.today().isoformat()
    line["machine"] = machine_label()  # times from different machines are not comparable: one marker and fit each
    if line["n_train"] != n:
        raise ValueError(f"asked for {n} training sequences, the corpus gave {line['n_train']}")
    return line


def main(argv: list[str] | None = None) -> dict:
    parser = cli.parser("python -m bench.attribution_scaling", __doc__)
    parser.add_argument("--model", required=True, help="a PRISM model folder")
    parser.add_argument("--base-db", required=True, help="its precompute database; each size gets a copy")
    parser.add_argument("--corpus", required=True, help="the training corpus (caches are built from its windows)")
    parser.add_argument("--sizes", type=sizes, default=[768, 1536, 3072, 12288, 24576],
                        help="training sequences per point, comma-separated")
    parser.add_argument("--ekfac-max", type=int, default=3072, help="run EK-FAC end to end up to this size")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--n-queries", type=int, default=50)
    parser.add_argument("--ekfac-queries", type=int, default=10, help="queries EK-FAC scores (one batch)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="folder: databases, work folders, scaling.jsonl")
    parser.add_argument("--plot", default=None, help="write the log-log plot here (PNG)")
    parser.add_argument("--plot-only", action="store_true", help="only redraw from OUT/scaling.jsonl")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER,
                        help="after `--`: more bench.attribution arguments for every size (e.g. --rank, --batch-size)")
    args = cli.parse(parser, argv)
    args.bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    if args.ekfac_max < 0 or args.seq_len < 2 or args.n_queries < 1:
        cli.fail(parser, "--ekfac-max must be >= 0, --seq-len >= 2 and --n-queries >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "scaling.jsonl"
    lines = _read_lines(jsonl)
    if not args.plot_only:
        if not Path(args.base_db).is_file():
            cli.fail(parser, f"--base-db {args.base_db} does not exist")
        for n in args.sizes:
            with cli.expected_errors(parser, RuntimeError, ValueError):
                line = run_size(args, n)
            before = lines.get(n) or {}
            if line.get("cache_reused") and before.get("cached_build_s") is not None:  # built by an earlier run
                line.update({k: before[k] for k in ("cached_build_s", "cached_build_peak_rss_mb")})
            lines[n] = line
            tmp = jsonl.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(lines[k]) + "\n" for k in sorted(lines)))
            tmp.replace(jsonl)
    ordered = extrapolate([lines[k] for k in sorted(lines)])
    result = summary(ordered)
    result["lines"] = [{k: line.get(k) for k in ("n_train", "cached_query_ms", "cached_product_ms", "cached_text_ms",
                                                  "cached_click_ms", "ekfac_query_ms", "ekfac_query_ms_extrapolated",
                                                  "reference_s", "speedup", "speedup_click", "speedup_extrapolated",
                                                  "top10_overlap", "cached_peak_rss_mb", "ekfac_peak_rss_mb",
                                                  "reference_peak_rss_mb", "cached_build_s")}
                       for line in ordered]
    if args.plot and ordered:
        write_png(figure(ordered, result["fits"]), Path(args.plot))
        result["plot"] = args.plot
    cli.print_json(result)
    return result


if __name__ == "__main__":
    main()
