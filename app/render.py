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
        via = ", ".join(f"#{p['prototype_id']} {signed_number(p['contribution'])}" for p in shares)
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
            f'({html.escape(row.get("source") or "")}, {html.escape(row.get("doc_id") or "")})</div></div>')


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
            f"- #{s['prototype_id']} {html.escape(s['label'] or '(no label)')} (overlap {s['overlap']:.2f}"
            f"{', sibling score ' + shown_score(s['sibling_score']) if s.get('sibling_score') is not None else ''})"
            + (f": {html.escape(s['separation'])}" if s.get("separation") else "")
            for s in card.siblings[:6])
    if card.coactive:
        md += "\n\nOften active with: " + ", ".join(
            f"#{c['prototype_id']} {html.escape(c['label'] or '')}" for c in card.coactive[:5])
    return md
