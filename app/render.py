"""HTML for the app's panels, built from the plain rows the precompute layer returns (segments, scores, sources):
precompute/ returns data, the app decides how it looks.

    html = attribution_html(rows)          # precompute.attribution.attribution_rows -> the training-data cards
    html = segments_html(row["segments"])  # a context: tokens shaded by activation, the target token outlined

Every piece of text is escaped; a link is made only for http(s) addresses.
"""

from __future__ import annotations

import html


def attribution_html(rows: list[dict]) -> str:
    """Escaped HTML cards for attribution rows (the "training data behind this token" panel): the sequence's text
    with its strongest tokens shaded, its score, the prototypes that carried it and its source."""
    cards = []
    for r in rows:
        source = html.escape(r.get("title") or r.get("doc_id") or "")
        url = r.get("url") or ""
        if url.startswith(("http://", "https://")):
            source = (f'<a href="{html.escape(url, quote=True)}" target="_blank" rel="noopener noreferrer">'
                      f"{source or html.escape(url)}</a>")
        shares = [p for p in r["prototypes"] if p["contribution"] != 0][:4]
        via = ", ".join(f"#{p['prototype_id']} {signed_number(p['contribution'])}" for p in shares) \
            or "the trained layers"  # the gradient reading: no prototype carries the score
        body = html.escape(r["error"]) if r.get("error") else segments_html(r["segments"])
        cards.append(
            f'<div class="prism-evidence prism-attribution"><div class="prism-evidence-text">…{body}…</div>'
            f'<div class="prism-evidence-source">#{r["rank"] + 1} · score {signed_number(r["score"])} · via {via} · '
            f'{source} '
            f'({html.escape(r.get("source") or "")}, {html.escape(r["doc_id"])}, tokens {r["seq_token_start"]}'
            f'–{r["seq_token_end"]}, characters {r["char_start"]}–{r["char_end"]})</div></div>')
    return "".join(cards)


def signed_number(x: float) -> str:
    """A signed score for people: whole numbers when large, three significant digits when small."""
    return f"{x:+,.0f}" if abs(x) >= 100 else f"{x:+.3g}"


def segments_html(segments: list[dict]) -> str:
    """A context as escaped HTML: tokens shaded by activation, the evidence token outlined."""
    out = []
    for s in segments:
        alpha = max(0.0, min(1.0, s["activation"]))
        style = f"background: rgba(255, 140, 0, {alpha:.2f});"
        if s["target"]:
            style += " outline: 2px solid #c0392b; font-weight: 600;"
        out.append(f'<span style="{style}" title="{s["activation"]:.3f}">{html.escape(s["text"])}</span>')
    return "".join(out)


SOURCE_NAMES = {"wiki": "Wikipedia", "news": "news (Lee corpus)", "sotu": "State of the Union address",
                "mail": "mail (SpamAssassin, ham)", "code": "package source and docs", "moby": "Moby-Dick",
                "kjv": "King James Bible", "fineweb": "FineWeb", "local": "local file"}


def source_name(source: str | None) -> str:
    """A corpus source as people read it ("kjv" -> "King James Bible"); an unknown one as it is."""
    return SOURCE_NAMES.get(source or "", source or "")


def evidence_html(row: dict) -> str:
    """One evidence row of a prototype's card: the context (or why its text could not be read) and its source."""
    text = html.escape(row["error"]) if row.get("error") else segments_html(row["segments"])
    source = html.escape(row.get("title") or row.get("doc_id") or "")
    if row.get("url"):
        url = html.escape(row["url"], quote=True)
        if url.startswith(("http://", "https://")):
            source = f'<a href="{url}" target="_blank" rel="noopener noreferrer">{source or url}</a>'
    return (f'<div class="prism-evidence"><div class="prism-evidence-text">…{text}…</div>'
            f'<div class="prism-evidence-source">activation {row["activation"]:.3f} · {source} '
            f'({html.escape(source_name(row.get("source")))}, {html.escape(row.get("doc_id") or "")})</div></div>')


def _band_range(rows: list[dict]) -> str:
    acts = [r["activation"] for r in rows]
    return f"{min(acts):.3f}–{max(acts):.3f}" if acts else ""


def banded_evidence_html(card) -> str:
    """The card's contexts in three bands of the activation range: the top ones (the evidence job's), then the
    middle and the low end of a uniform sample of every position where the prototype is active (the bands job's);
    each band says its activation range, so a reader sees what the prototype does when it fires weakly too."""
    sections = []
    bands = card.bands or {}
    for title, rows, note in (
            ("Top", card.evidence, "its strongest activations in the corpus"),
            ("Middle", bands.get("middle", []), "around the median of a uniform sample of its "
                                                f"{bands.get('sampled', 0)} active positions"),
            ("Low", bands.get("low", []), "the weakest of that sample")):
        if not rows:
            continue
        sections.append(f'<div class="prism-band"><b>{title}</b> · activation {_band_range(rows)} · '
                        f'<small>{html.escape(note)}</small></div>' + "".join(evidence_html(r) for r in rows))
    if not sections:
        return "<p>No evidence rows for this prototype.</p>"
    if not bands.get("sampled"):
        sections.append("<p><small>This database has no activation bands (only the top contexts): build them "
                        "with <code>python -m precompute build ... --jobs bands</code>.</small></p>")
    return "".join(sections)


def activation_text_html(tokens: list[str], activations: list[float]) -> str:
    """A text as escaped HTML, each token shaded by one prototype's activation (its value on hover), spaces and
    line breaks kept."""
    peak = max([a for a in activations if a > 0], default=1.0)
    out = []
    for token, a in zip(tokens, activations):
        alpha = 0.0 if a <= 0 else 0.15 + 0.85 * min(1.0, a / peak)
        out.append(f'<span class="prism-try-token" style="background: rgba(255, 140, 0, {alpha:.2f});" '
                   f'title="{a:.4f}" data-activation="{a:.6f}">{html.escape(token)}</span>')
    return f'<div class="prism-try" style="white-space: pre-wrap; line-height: 1.8;">{"".join(out)}</div>'


def shown_score(x) -> str:
    return "n/a" if x is None else f"{float(x):.3f}"


def card_markdown(card) -> str:
    """A prototype card's text (precompute.query.PrototypeCard): label, its two sides and topic, every held-out
    score with what it means, siblings and what separates them, co-active prototypes."""
    md = (f"### #{card.prototype_id} {html.escape(card.label or '(no label)')}\n"
          f"**{html.escape(card.category or 'unlabelled')}**"
          + (f" · {html.escape(card.topic)}" if card.topic else "") + "  \n")
    if card.fires_on or card.pushes:
        md += (f"- **fires on** {html.escape(card.fires_on or '(not said)')}\n"
               f"- **pushes the next token toward** {html.escape(card.pushes or '(not said)')}\n\n")
    if card.detection_random is not None:
        md += (f"detection {shown_score(card.detection_random)} vs random · "
               f"{shown_score(card.detection_sibling)} vs siblings · ")
    md += (f"label score {shown_score(card.label_score)}"
           f" · sibling score {shown_score(card.sibling_score)} · active on "
           f"{card.activation_count or 0} corpus tokens, mean activation {card.mean_activation or 0:.3f}, "
           f"max {card.max_activation or 0:.3f}  \n"
           f"<small>Every score is held out: the label was written from other evidence of this prototype. "
           + ("Detection is a balanced accuracy (0.5 = chance, 1 = always right): given the label, tell this "
              "prototype's contexts from random ones, or from its siblings' (the prototypes on the same tokens). "
              if card.detection_random is not None else "")
           + "Label and sibling score read like an AUROC: 0.5 = the label says nothing, 1 = it singles the "
             "prototype out, against random other prototypes' contexts or against its siblings' only.</small>")
    if card.siblings:
        md += "\n\n**Siblings** (same tokens; what separates them):\n" + "\n".join(
            f"- {proto_link(s['prototype_id'], s['label'] or '(no label)')} (overlap {s['overlap']:.2f}"
            f"{', sibling score ' + shown_score(s['sibling_score']) if s.get('sibling_score') is not None else ''})"
            + (f": {html.escape(s['separation'])}" if s.get("separation") else "")
            for s in card.siblings[:6])
    if card.coactive:
        md += "\n\nOften active with: " + ", ".join(
            proto_link(c["prototype_id"], c["label"] or "") for c in card.coactive[:5])
    return md


def proto_link(prototype_id: int, label: str) -> str:
    """A link that opens another prototype's card in place (the page's CLICK_JS catches #prototype-N links)."""
    text = f"#{int(prototype_id)} {label}".strip().replace("[", "(").replace("]", ")")
    return f"[{html.escape(text)}](#prototype-{int(prototype_id)})"


def carried_line(c, in_prompt: bool = False) -> str:
    """What the prototypes carry of the choice, in words (prism.explain.Carried), marked when the residual decides.
    A sampled token below the runner-up was not the model's choice: then the line splits the gap it lost by."""
    other = html.escape(repr(c.runner_up))
    parts = f"the prototypes **{100 * c.prototypes:.0f}%**, the residual **{100 * c.residual:.0f}%**"
    if c.prototypes > 1 or c.prototypes < 0:
        parts += " (the two pull opposite ways)"
    if c.gap < 0:
        return f"{'Below' if in_prompt else 'Sampled below'} {other} (logit gap {c.gap:+.3f}); of that gap {parts}."
    text = f"Of this choice over {other} (logit gap {c.gap:+.3f}) {parts} carry."
    if c.residual_decides:
        text = ("⚠ **The residual decides this choice, not the prototypes**: the slices do not explain why this "
                "token beat the runner-up. " + text)
    return text


def probability(p: float) -> str:
    """A probability to read: three decimals, or two significant digits below 0.001 (never a bare '0.000')."""
    return f"{p:.3f}" if p >= 0.001 or p == 0 else f"{p:.1e}"


def probability_note(d) -> str:
    """', probability 0.42' for a decomposition that carries one (the position's softmax), else nothing."""
    return "" if d.probability is None else f", probability {probability(d.probability)}"


def token_summary(view, why) -> str:
    """The explained token in words: its sum, how it was chosen (with probabilities), what the prototypes carry of
    the choice, re-routing, and why it changed (app/core.py TokenView, WhyChanged)."""
    d = view.chosen
    if view.in_prompt:
        name, source = f"Prompt token {view.index}", " (what the model expected here from the prompt before it)"
    else:
        name, source = f"Token {view.index}", f" (while generating: {view.stream_logit:.4f})"
    lines = [f"**{name}: {html.escape(repr(d.token))}** — residual {d.residual:+.4f} + "
             f"{len(d.slices)} prototype slice(s) = **{d.total:.4f}**; the model's logit is **{d.logit:.4f}**"
             f"{source}" + probability_note(d) + "."]
    others = [a for a in view.alternatives if a.token_id != d.token_id]
    if others:
        best = max(view.alternatives, key=lambda a: a.logit)
        if view.in_prompt:  # the user wrote this token; the model only guessed
            lines.append(f"The model's first guess here: {html.escape(repr(best.token))} at {best.logit:.4f}"
                         f"{probability_note(best)}" + (" (this token)" if best.token_id == d.token_id else "")
                         + ".")
        elif best.token_id == d.token_id:
            lines.append(f"Chosen: the highest logit; next best {html.escape(repr(others[0].token))} at "
                         f"{others[0].logit:.4f}{probability_note(others[0])}.")
        else:
            lines.append(f"Chosen (sampled): {html.escape(repr(d.token))} at {d.logit:.4f}; highest logit "
                         f"{html.escape(repr(best.token))} at {best.logit:.4f}{probability_note(best)}.")
    if view.carried is not None:
        lines.append(carried_line(view.carried, view.in_prompt))
    if d.rerouted_ids:
        lines.append(f"Re-routed here: {', '.join(f'#{p}' for p in d.removed_ids)} switched off, "
                     f"{', '.join(f'#{p}' for p in d.rerouted_ids)} took their slots (their slices are in the sum).")
    elif d.removed_ids:
        lines.append(f"Switched off here: {', '.join(f'#{p}' for p in d.removed_ids)} (their slices are removed).")
    text = "  \n".join(lines)
    if why is not None:
        text += f"  \n**Why it changed:** {html.escape(why.message)}." + why_table(why)
    return text


def why_table(why, rows: int = 8) -> str:
    """The prototypes whose activation changed at the token, as a table to read aloud: who, what happened to it,
    and its effect on logit(new) - logit(reference); a last row gives the sum of all of them, which is the whole gap
    the activation changes make (more than `rows`: the rest summed in one row)."""
    if not why.effects:
        return ""
    gap = f"logit({why.new_token!r}) − logit({why.reference_token!r})"
    out = ["", "", f"| prototype | role | effect on {md_cell(gap)} |", "|---|---|---:|"]
    for e in why.effects[:rows]:
        role = "took a suppressed slot (re-routing)" if e["role"] == "replacement" else "intervened on"
        out.append(f"| #{e['prototype_id']} {md_cell(e['label'] or '')} | {role} | {e['effect']:+.3f} |")
    rest = why.effects[rows:]
    if rest:
        out.append(f"| {len(rest)} more | | {sum(e['effect'] for e in rest):+.3f} |")
    out.append(f"| **all {len(why.effects)} together** | | **{sum(e['effect'] for e in why.effects):+.3f}** |")
    return "\n".join(out)


def md_cell(text: str) -> str:
    """Text safe inside a Markdown table cell: HTML escaped, pipes and line breaks neutralised."""
    return html.escape(text).replace("|", "\\|").replace("\n", " ")

