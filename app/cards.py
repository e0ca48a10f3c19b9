"""The prototype card's handlers: the card itself (label, scores, contexts from three bands of the activation range,
both ends of the logit signature, siblings and co-active prototypes as links) and "try it on your text", the
prototype's activation on every token of a text the user types. Wired by app/ui.py; also HTTP endpoints
(prototype, try_prototype).
"""

from __future__ import annotations

import html
import json

from app import plots, render
from app.core import AppError, Studio
from app.messages import guarded, problem
from app.panels import CardPanel

N_TOP, N_BAND = 12, 4  # contexts a card shows: the top ones, then N_BAND from the middle and N_BAND from the low end
NO_PROTOTYPE = "Pick a prototype: click a token, a table row, a chart's bar or a point on the map."
NO_CARD_PLOT = "no prototype selected"  # the card's charts before a prototype is picked


@guarded
def prototype(studio: Studio, prototype_id: float | str | None):
    """A prototype's card (CardPanel: markdown, signature plot, histogram plot, evidence html, card json)."""
    try:
        if prototype_id is None or str(prototype_id).strip() == "":
            empty = plots.empty_figure(NO_CARD_PLOT)
            return CardPanel(NO_PROTOTYPE, empty, empty, "", None)
        card = studio.need_db().card(prototype_id, n_evidence=N_TOP, n_band=N_BAND)
        raises, lowers = studio.signature_ends(card.prototype_id)
    except AppError as err:
        empty = plots.empty_figure("no card")
        return CardPanel(problem(err), empty, empty, "", None)
    md = render.card_markdown(card)
    data = card.as_dict()
    keep = ("rank", "doc_id", "activation", "token", "url", "title", "source")
    data["evidence"] = [{k: e[k] for k in keep} for e in card.evidence]
    data["bands"] = {band: [{k: e[k] for k in keep} for e in card.bands.get(band, [])] for band in ("middle", "low")}
    data["bands"]["sampled"] = card.bands.get("sampled", 0)
    data["signature_lowers"] = lowers
    return CardPanel(md, plots.signature_figure(card, raises, lowers), plots.histogram_figure(card),
                     render.banded_evidence_html(card), json.loads(json.dumps(data, default=float)))


@guarded
def try_text(studio: Studio, prototype_id, text):
    """The prototype's activation on each token of `text`: (html, data {prototype_id, tokens, activations})."""
    try:
        if prototype_id is None or str(prototype_id).strip() == "":
            raise AppError("open a prototype first (its id in the box above)")
        if not isinstance(text, str) or not text.strip():
            raise AppError("type a text to run this prototype over")
        pid = studio.check_prototype(prototype_id)
        tokens, acts = studio.activations_on(text, pid)
    except AppError as err:
        return problem(err), None
    top = max(acts) if acts else 0.0
    active = sum(a > 0 for a in acts)
    head = (f"<p>#{pid} is active on <b>{active}</b> of {len(tokens)} tokens"
            + (f", most at {html.escape(repr(tokens[acts.index(top)]))} ({top:.3f})" if active else "")
            + ". Shading: its activation at each token (hover for the value).</p>")
    return head + render.activation_text_html(tokens, acts), {"prototype_id": pid, "tokens": tokens,
                                                               "activations": acts}
