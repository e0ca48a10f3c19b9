"""The handlers of the interventions panel: suppress, scale or inject a prototype; suppress a category, every
search match or a preset; how suppression acts; remove and clear; load a fitted controller. Each returns an
InterventionsPanel (session, the list, status) or, for the controller, a ControllerPanel, and is wired by app/ui.py
like the handlers of app/handlers.py, whose conventions it shares (a new Session, never a shared one changed;
messages from app/messages.py, never raw exceptions).
"""

from __future__ import annotations

from dataclasses import replace

import gradio as gr

from app import controllers as app_controllers
from app import limits
from app.core import AppError, Studio
from app.messages import guarded, ok, problem
from app.panels import ControllerPanel, InterventionsPanel
from app.session import (
    MAX_INJECT,
    MAX_SCALE,
    SUPPRESS_MODE_NAMES,
    Session,
    group_item,
    inject_item,
    scale_item,
    suppress_item,
)


def _intervened(studio: Studio, session: Session, make) -> InterventionsPanel:
    try:
        if session.n_rows >= studio.limits.max_interventions:
            raise AppError(f"this app takes at most {studio.limits.max_interventions} interventions at once: remove "
                           "some (or suppress a category or a search result as one row)")
        session = session.add(make())
    except (AppError, ValueError) as err:
        return InterventionsPanel(session, session.rows(), problem(err))
    return InterventionsPanel(session, session.rows(), ok(f"added: {session.items[-1].describe()}. Generate again "
                                                          "to compare."))


def suppressed(studio: Studio, prototype_id):
    """One checked suppress item (the page's Suppress, and the tools' suppress lists)."""
    pid = studio.check_prototype(prototype_id)
    return suppress_item(pid, studio.label(pid)[0])


def scaled(studio: Studio, prototype_id, factor):
    """One checked scale item: a finite factor in [0, MAX_SCALE]."""
    pid = studio.check_prototype(prototype_id)
    return scale_item(pid, limits.number("the scale factor", factor, 0, MAX_SCALE), studio.label(pid)[0])


def injected(studio: Studio, prototype_id, activation):
    """One checked inject item: an activation in (0, MAX_INJECT]."""
    pid = studio.check_prototype(prototype_id)
    value = limits.number("the injected activation", activation, 0, MAX_INJECT)
    if value <= 0:
        raise AppError(f"the injected activation must be above 0 (at most {MAX_INJECT:g}); to switch a "
                       "prototype off, suppress it")
    return inject_item(pid, value, studio.label(pid)[0])


@guarded
def suppress(studio: Studio, prototype_id, session: Session):
    return _intervened(studio, session, lambda: suppressed(studio, prototype_id))


@guarded
def scale(studio: Studio, prototype_id, factor: float, session: Session):
    return _intervened(studio, session, lambda: scaled(studio, prototype_id, factor))


@guarded
def inject(studio: Studio, prototype_id, activation: float, session: Session):
    """Prototype `prototype_id` active at every token with `activation`, selected there or not: its slice
    activation * W p enters every logit (steering with a prototype the text never reaches)."""
    return _intervened(studio, session, lambda: injected(studio, prototype_id, activation))


@guarded
def suppress_category(studio: Studio, category: str, session: Session):
    return _intervened(studio, session,
                       lambda: group_item("category", str(category), studio.need_db().category_ids(str(category))))


@guarded
def suppress_search(studio: Studio, text: str, mode: str, session: Session):
    def make():
        needle = limits.text("the search", text, 100_000)
        kind = "semantic" if mode == "semantic" else "label"
        ids = [r["prototype_id"] for r in studio.need_db().search(needle, kind, k=10 if kind == "semantic" else 10_000)]
        return group_item("search", f"{kind} {needle.strip()[:60]!r}", ids)

    return _intervened(studio, session, make)


@guarded
def apply_preset(studio: Studio, name: str, session: Session):
    def make():
        title, ids = studio.need_db().preset_ids(name)
        return group_item("preset", title, ids)

    return _intervened(studio, session, make)


@guarded
def suppress_mode(mode: str, session: Session):
    """How this session's suppressions act: 'reroute' (the nearest other prototypes take the slots) or 'zero'
    (the slices are removed). Returns an InterventionsPanel."""
    try:
        session = session.with_suppress_mode(mode)
    except ValueError as err:
        return InterventionsPanel(session, session.rows(), problem(err))
    return InterventionsPanel(session, session.rows(), ok(
        f"suppressions now {SUPPRESS_MODE_NAMES[session.suppress_mode]}. Generate again to compare."))


@guarded
def remove_intervention(index, session: Session):
    try:
        session = session.remove(limits.whole("the row number", index, 0, max(session.n_rows - 1, 0)))
    except (AppError, ValueError) as err:
        return InterventionsPanel(session, session.rows(), problem(err))
    return InterventionsPanel(session, session.rows(), ok("removed"))


@guarded
def clear_interventions(session: Session):
    return InterventionsPanel(session.clear(), [], ok("all interventions removed"))


@guarded
def list_interventions(session: Session):
    return session.rows(), session.interventions().__repr__()


@guarded
def controller(studio: Studio, path: str, upload, enabled: bool, session: Session, shipped: str | None = None):
    """Load a fitted prototype controller (a shipped one by name, a server path or an upload) into this session,
    switch it on or off for the intervened text, and list the prototypes it raises and lowers most (ControllerPanel:
    session, rows, status, description)."""
    try:
        loaded, name = session.controller, session.controller_name
        if upload:
            loaded, name = app_controllers.load(studio, upload, upload=True), None
        elif (path or "").strip():
            loaded = app_controllers.load(studio, path.strip())
            name = app_controllers.shipped_name(path.strip())
        elif shipped:
            loaded, name = app_controllers.load_shipped(studio, shipped), str(shipped)
        if loaded is None:
            raise AppError("no controller loaded: pick a shipped one, give a path or upload a file written by "
                           "`python -m bench.controllers fit`")
    except AppError as err:
        return ControllerPanel(session, [], problem(err), None)
    session = replace(session, controller=loaded, controller_on=bool(enabled), controller_name=name)
    view = app_controllers.describe(studio, loaded)
    state = "on: generate again to compare" if enabled else "loaded, off (tick the box to use it)"
    return ControllerPanel(session, app_controllers.table_rows(view), ok(f"controller {view['name']} {state}"), view)


@guarded
def pick_controller_row(evt: gr.SelectData):
    """A click on a row of the controller table -> its prototype id (to open the card)."""
    return evt.row_value[1]
