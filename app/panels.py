"""What each handler returns: a named tuple per panel. app/ui.py wires every event's outputs from these field names
(Components.outputs(GenerationPanel) = the components of those names, in this order), so a handler and the layout
cannot disagree about which value goes where; the API (gradio_client) receives the same fields in the same order.

    return TokenPanel(waterfall, alternatives, summary, rows, top, session, data)    # app/handlers.py
    token.proto_id                                                                   # read by name, not position
    skipped(RestorePanel)                                                            # leave every field as it is
"""

from __future__ import annotations

from typing import Any, NamedTuple

import gradio as gr

from app.session import Session


class GenerationPanel(NamedTuple):
    original: Any  # HighlightedText value of the original text
    intervened: Any
    gen_status: str
    intervened_title: str
    session: Session
    result_json: dict | None


class TokenPanel(NamedTuple):
    waterfall: Any  # plotly figure: the chosen token's residual and slices
    alternatives: Any  # plotly figure: the top tokens at that position
    token_md: str
    active: list
    proto_id: int | None  # the top prototype (its card opens next)
    session: Session
    token_json: dict | None


class CardPanel(NamedTuple):
    card_md: str
    signature: Any
    histogram: Any
    evidence: str
    card_json: dict | None


class ClearPanel(NamedTuple):
    """A new generation empties the explanation panel and the training-data panel."""

    waterfall: Any
    alternatives: Any
    token_md: str
    active: list
    token_json: dict | None
    attribution_html: str
    attribution_json: dict | None
    gen_status: str


class RestorePanel(NamedTuple):
    """The page's settings and interventions from a shared link."""

    prompt: Any
    max_new: Any
    temperature: Any
    top_p: Any
    seed: Any
    session: Any
    iv_table: Any
    iv_status: Any
    iv_suppress_mode: Any
    pending: Any
    gen_status: Any


class InterventionsPanel(NamedTuple):
    session: Session
    iv_table: list
    iv_status: str


class ControllerPanel(NamedTuple):
    session: Session
    ctl_table: list
    ctl_status: str
    ctl_json: Any  # the controller's description, None when none is loaded


# The token a restored link selected: which text and token, its explanation and its top prototype's card.
PendingPanel = NamedTuple("PendingPanel", [("run", Any), ("index", Any), *TokenPanel.__annotations__.items(),
                                           *CardPanel.__annotations__.items()])


def skipped(panel: type[tuple]):
    """The panel with every field left as it is on the page (gr.skip)."""
    return panel(*(gr.skip() for _ in panel._fields))
