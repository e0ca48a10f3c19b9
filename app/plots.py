"""Plotly figures of the app: a token's logit as residual + prototype slices, the alternatives at a position, a
prototype's logit signature and activation histogram, and the 2-D map. Pure functions of app.core values.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from app import render
from app.core import NO_PROTOTYPE, UNLABELLED, TokenDecomposition, TokenView
from precompute.query import PrototypeCard
from precompute.schema import CATEGORIES

# One colour per category, in CATEGORIES' order, far apart (Kelly's colours of maximum contrast, and a cyan):
# morphology blue, scaffolding orange, medical/bio red, institutional purple, numbers/time green, science/tech
# light blue, named entities yellow, social pink, boilerplate reddish brown, environment yellow-green, urls cyan,
# finance buff, misc grey.
_PALETTE = ("#0067a5", "#f38400", "#be0032", "#875692", "#008856", "#a1caf1", "#f3c300", "#e68fac", "#882d17",
            "#8db600", "#17becf", "#c2b280", "#848482")
CATEGORY_COLORS = dict(zip(CATEGORIES, _PALETTE, strict=True))
CATEGORY_COLORS[UNLABELLED] = "#c7c7c7"
CATEGORY_COLORS[NO_PROTOTYPE] = "#eeeeee"
RESIDUAL_COLOR = "#7f7f7f"
# Transparent panels, so a chart sits on the page's own background in the light and the dark theme; dark text and
# grid lines here, which the page's CSS lightens in the dark theme (app/ui.py CSS).
_LAYOUT = dict(template="plotly_white", margin=dict(l=10, r=10, t=50, b=10), height=360,
               paper_bgcolor="rgba(0,0,0,0)", plot_bgcolor="rgba(0,0,0,0)", font=dict(color="#222222"))


def category_color(category: str | None) -> str:
    return CATEGORY_COLORS.get(category or UNLABELLED, CATEGORY_COLORS[UNLABELLED])


def slice_name(prototype_id: int, label: str) -> str:
    label = label if len(label) <= 32 else label[:31] + "…"
    return f"#{prototype_id} {label}".strip()


def decomposition_figure(d: TokenDecomposition, carried=None) -> go.Figure:
    """Horizontal waterfall, read top to bottom: the residual first (set apart), then one bar per active prototype
    from the largest contribution to the smallest, ending in the exact sum; a dotted line marks the model's logit,
    which the sum meets. carried (app.core.Carried, optional) adds what the prototypes carry of the choice over the
    runner-up to the title, in red when the residual decides."""
    slices = sorted(d.slices, key=lambda s: -s.contribution)
    names = ["residual (W·r + b)"] + [slice_name(s.prototype_id, s.label) for s in slices] + ["sum"]
    values = [d.residual] + [s.contribution for s in slices] + [d.total]
    hover = [f"residual (W·r + b): {d.residual:+.4f}"] + [
        f"#{s.prototype_id} {s.label}<br>{s.category}<br>activation {s.activation:.4f}<br>"
        f"contribution {s.contribution:+.4f}" for s in slices] + [f"sum {d.total:.4f}<br>model logit {d.logit:.4f}"]
    fig = go.Figure(go.Waterfall(
        orientation="h", y=names, x=values, measure=["relative"] * (len(values) - 1) + ["total"], hovertext=hover,
        hoverinfo="text", text=[f"{v:+.3f}" for v in values[:-1]] + [f"{d.total:.4f}"], textposition="outside",
        customdata=[-1] + [s.prototype_id for s in slices] + [-1],  # a click on a bar opens its card (CLICK_JS)
        cliponaxis=False, connector=dict(line=dict(color="#bbbbbb")),
        increasing=dict(marker=dict(color="#59a14f")), decreasing=dict(marker=dict(color="#e15759")),
        totals=dict(marker=dict(color="#4e79a7"))))
    running = [sum(values[: i + 1]) for i in range(len(values) - 1)]
    low, high = min(0.0, *running, d.logit), max(0.0, *running, d.logit)
    pad = 0.18 * (high - low or 1.0)  # room for the values written outside the bars
    fig.add_vline(x=d.logit, line=dict(color="black", dash="dot", width=1),
                  annotation=dict(text=f"model logit {d.logit:.4f}", font=dict(size=11)),
                  annotation_position="top")
    title = f"logit of {d.token!r} = residual + {len(slices)} slice(s) = {d.total:.4f}"
    if carried is not None:
        what = "the gap to" if carried.gap < 0 else "the choice over"
        decides = carried.residual_decides and carried.gap > 0
        colour = "#c0392b" if decides else "#2e7d32" if carried.gap > 0 else "#555555"
        title += (f"<br><span style='font-size:12px;color:{colour}'>prototypes carry {100 * carried.prototypes:.0f}% "
                  f"of {what} {carried.runner_up!r}, the residual {100 * carried.residual:.0f}%"
                  + (" (the residual decides)" if decides else "") + "</span>")
    fig.update_layout(title=dict(text=title, font=dict(size=14)), showlegend=False,
                      yaxis=dict(autorange="reversed", automargin=True),
                      xaxis=dict(range=[low - pad, high + pad], zeroline=True),
                      **{**_LAYOUT, "height": 120 + 30 * len(names),
                         "margin": dict(l=10, r=30, t=75 if carried else 60, b=30)})
    return fig


def alternatives_figure(view: TokenView) -> go.Figure:
    """The top tokens at the position, read like the waterfall: one horizontal bar per candidate (highest logit
    first), built from the residual (grey, first) and one segment per active prototype (the same prototypes for
    every candidate, in the order of their slice of the chosen token, one colour each); a diamond and its value
    mark the exact sum, which is the candidate's logit."""
    chosen = view.chosen.token_id
    tokens = [f"{a.token!r}" + (" ◀ chosen" if a.token_id == chosen else "") for a in view.alternatives]
    fig = go.Figure()
    fig.add_bar(y=tokens, x=[a.residual for a in view.alternatives], orientation="h", name="residual (W·r + b)",
                marker_color=RESIDUAL_COLOR,
                hovertext=[f"{t}: residual {a.residual:+.4f}" for t, a in zip(tokens, view.alternatives)],
                hoverinfo="text")
    order = [s.prototype_id for s in sorted(view.chosen.slices, key=lambda s: -s.contribution)]
    for a in view.alternatives:
        order += [s.prototype_id for s in a.slices if s.prototype_id not in order]
    for n, pid in enumerate(order):
        values, label = [], ""
        for a in view.alternatives:
            match = [s for s in a.slices if s.prototype_id == pid]
            values.append(match[0].contribution if match else 0.0)
            label = label or (match[0].label if match else "")
        fig.add_bar(y=tokens, x=values, orientation="h", name=slice_name(pid, label), customdata=[pid] * len(tokens),
                    marker_color=_PALETTE[n % len(_PALETTE)], hoverinfo="text",
                    hovertext=[f"{t}: #{pid} {label} {v:+.4f}" for t, v in zip(tokens, values)])
    fig.add_scatter(y=tokens, x=[a.logit for a in view.alternatives], mode="markers+text", name="logit (= the sum)",
                    marker=dict(symbol="diamond", size=12, color="black", line=dict(color="white", width=1)),
                    text=[f"{a.logit:.3f}" + ("" if a.probability is None else
                                              f" (p {render.probability(a.probability)})")
                          for a in view.alternatives], textposition="middle right",
                    cliponaxis=False, hoverinfo="text",
                    hovertext=[f"{t}: logit {a.logit:.4f}" for t, a in zip(tokens, view.alternatives)])
    fig.update_layout(barmode="relative",
                      title=dict(text="top tokens at this position: residual + the same prototypes' slices",
                                 font=dict(size=14)),
                      yaxis=dict(autorange="reversed", automargin=True), xaxis=dict(zeroline=True),
                      legend=dict(font=dict(size=11), orientation="h", yanchor="top", y=-0.12, x=0),
                      **{**_LAYOUT, "height": 200 + 36 * len(tokens) + 22 * ((len(order) + 2) // 2),
                         "margin": dict(l=10, r=60, t=50, b=20)})
    return fig


def signature_figure(card: PrototypeCard, raises: list[dict] | None = None, lowers: list[dict] | None = None,
                     n: int = 10) -> go.Figure:
    """The logit signature W·p at both ends: the tokens the prototype raises most (its category's colour) and, when
    given, those it lowers most (red), each bar the logit it adds per unit of activation."""
    up = (raises if raises is not None else card.signature)[:n]
    down = list(reversed((lowers or [])[:n]))  # the most lowered at the bottom
    rows = up + down
    fig = go.Figure(go.Bar(x=[r["value"] for r in rows], y=list(range(len(rows))), orientation="h",
                           marker_color=[category_color(card.category)] * len(up) + ["#d62728"] * len(down),
                           hovertext=[f"{r['token']!r}: {r['value']:+.4f} per unit of activation" for r in rows],
                           hoverinfo="text"))
    title = "logit signature W·p: tokens it raises" + (" (top) and lowers (red)" if down else "")
    # positions, not token texts, on the axis: two tokens can print alike (byte pieces print as '�')
    fig.update_layout(title=dict(text=title, font=dict(size=14)),
                      yaxis=dict(autorange="reversed", automargin=True, tickmode="array",
                                 tickvals=list(range(len(rows))), ticktext=[f"{r['token']!r}" for r in rows]),
                      xaxis=dict(zeroline=True), **{**_LAYOUT, "height": 120 + 20 * len(rows)})
    return fig


def histogram_figure(card: PrototypeCard) -> go.Figure:
    edges, counts = card.hist_edges or [], card.hist_counts or []
    centres = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
    width = (edges[1] - edges[0]) if len(edges) > 1 else 1
    fig = go.Figure(go.Bar(x=centres, y=counts, width=width * 0.95, marker_color=category_color(card.category)))
    fig.update_layout(title=dict(text="activation histogram (corpus)", font=dict(size=14)),
                      xaxis_title="activation", yaxis_title="tokens", **{**_LAYOUT, "height": 300})
    return fig


def _view_range(values: list[float], tail: float = 0.01, margin: float = 0.06) -> tuple[float, float]:
    """The axis range that holds all but the outermost `tail` of points at either end (plus a margin): one far
    outlier would otherwise squeeze every other point into a corner."""
    lo, hi = (float(v) for v in np.quantile(np.asarray(values, dtype=float), [tail, 1 - tail]))
    span = (hi - lo) or 1.0
    return lo - margin * span, hi + margin * span


def map_figure(points: list[dict], highlight: set[int] = frozenset(), selected: int | None = None,
               category: str | None = None) -> go.Figure:
    """The prototypes on their 2-D map, one trace per category; customdata carries the prototype id so a click
    can open its card. Outliers are pinned to the edge of the view (open diamonds, their hover says so) instead
    of squeezing the map. `highlight` (search results) are ringed, `selected` (the open card) is a star, and with a
    `category` the other categories are greyed out."""
    fig = go.Figure()
    if not points:
        return empty_figure("no map in this database (python -m precompute.map)")
    (x0, x1), (y0, y1) = _view_range([p["x"] for p in points]), _view_range([p["y"] for p in points])
    clip = lambda r: (min(max(r["x"], x0), x1), min(max(r["y"], y0), y1))  # noqa: E731
    inside = lambda r: clip(r) == (r["x"], r["y"])  # noqa: E731
    trace = fig.add_scattergl if len(points) > 4000 else fig.add_scatter  # SVG unless too many points
    hover = lambda r, note="": (f"#{r['prototype_id']} {r['label'] or ''}<br>{r['category'] or UNLABELLED}<br>"  # noqa: E731
                                f"{r['activation_count'] or 0} tokens{note}")

    def add(rows, name, marker, note=""):
        trace(x=[clip(r)[0] for r in rows], y=[clip(r)[1] for r in rows], mode="markers", name=name,
              customdata=[r["prototype_id"] for r in rows], text=[hover(r, note) for r in rows], hoverinfo="text",
              marker=marker)

    shown = [p for p in points if category is None or (p["category"] or UNLABELLED) == category]
    others = [p for p in points if p not in shown]
    if others:
        add(others, "other categories", dict(color="#d9d9d9", size=5))
    by_category: dict[str, list[dict]] = {}
    for p in shown:
        if inside(p):
            by_category.setdefault(p["category"] or UNLABELLED, []).append(p)
    for name, rows in sorted(by_category.items()):
        add(rows, name, dict(color=category_color(name), size=7, line=dict(width=0.5, color="white")))
    pinned = [p for p in shown if not inside(p)]
    if pinned:
        add(pinned, f"outliers, pinned to the edge ({len(pinned)})",
            dict(symbol="diamond-open", size=9, line=dict(width=1.5),
                 color=[category_color(r["category"]) for r in pinned]), "<br>(an outlier: pinned to the edge)")
    found = [p for p in points if p["prototype_id"] in highlight]
    if found:
        add(found, f"search results ({len(found)})",
            dict(symbol="circle-open", size=15, line=dict(width=2.5), color="#111111"))
    chosen = [p for p in points if p["prototype_id"] == selected]
    if chosen:
        add(chosen, f"#{selected} (open card)",
            dict(symbol="star", size=20, color="#ffd400", line=dict(width=1.5, color="#111111")))
    fig.update_layout(title=dict(text="prototype map (click a point to open its card)", font=dict(size=14)),
                      xaxis=dict(visible=False, range=[x0, x1]), yaxis=dict(visible=False, range=[y0, y1]),
                      **{**_LAYOUT, "height": 480})
    return fig


def contrast_figure(c, token_a: str, token_b: str, labels: dict[int, str], top: int = 12) -> go.Figure:
    """Why token a and not token b (prism.explain.Contrast): one bar for the residual and one per prototype (the
    largest parts; the rest summed), green where it favours a, red where it favours b; they add up to the gap."""
    shown = list(zip(c.prototype_ids, c.contributions))[:top]
    rest = sum(c.contributions[top:])
    names = ["residual (W·r + b)"] + [slice_name(p, labels.get(p, "")) for p, _ in shown]
    whole = ["residual (W·r + b)"] + [f"#{p} {labels.get(p, '')}".strip() for p, _ in shown]  # hover: whole labels
    values = [c.residual] + [v for _, v in shown]
    ids = [-1] + [p for p, _ in shown]
    if len(c.contributions) > top:
        names.append(f"{len(c.contributions) - top} other prototype(s)")
        whole.append(names[-1])
        values.append(rest)
        ids.append(-1)
    fig = go.Figure(go.Bar(y=names, x=values, orientation="h", text=[f"{v:+.3f}" for v in values],
                           marker_color=["#7f7f7f"] + ["#2ca02c" if v > 0 else "#d62728" for v in values[1:]],
                           customdata=ids, hoverinfo="text",
                           hovertext=[f"{n}: {v:+.4f}" for n, v in zip(whole, values)]))
    fig.update_layout(title=dict(text=f"why {token_a!r} and not {token_b!r}: gap {c.margin:+.3f} = these parts "
                                      "(green favours the first)", font=dict(size=14)),
                      yaxis=dict(autorange="reversed", automargin=True),
                      **{**_LAYOUT, "height": 120 + 26 * len(names)})
    return fig


def empty_figure(message: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_layout(xaxis=dict(visible=False), yaxis=dict(visible=False), **{**_LAYOUT, "height": 200})
    return fig
