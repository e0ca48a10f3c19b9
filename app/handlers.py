"""The app's handlers: plain functions, one per UI action, that app/ui.py wires to the page (the interventions
panel's are in app/interventions.py).

Every handler takes the shared, read-only Studio first (bound with functools.partial) and the user's Session (a
gr.State value) where it needs one, and returns a new Session instead of changing a shared value. Every public
handler is also an HTTP endpoint (api_name in app/ui.py) that `gradio_client` can call:

    generate, decompose, search, map, attribute, link, export_generation, export_interventions,
    import_interventions, export_table, export_evidence (here) and suppress, scale, suppress_category,
    suppress_search, preset, suppress_mode, remove_intervention, clear_interventions, interventions, controller
    (app/interventions.py); prototype, try_prototype (app/cards.py)

Problems the user can cause (empty prompt, unknown id, no database, ...) come back as a message in a status line;
the app keeps running.

Length: about 690 lines, because the generation and its Stop protocol (RunControl, the late Stop that cuts a text
the page had not shown yet) sit beside the handlers that read the session they write; the next split is to move
generate, RunControl and request_stop into a module of their own.
"""

from __future__ import annotations

import html
import json
import logging
import math
import threading
from dataclasses import replace
from pathlib import Path

import gradio as gr

from app import controllers as app_controllers
from app import export, limits, plots, render, share
from app.attribution import EMPTY as EMPTY_ATTRIBUTION
from app.attribution import attribution_panel
from app.cards import prototype, try_text  # noqa: F401 (handlers of the card, app/cards.py)
from app.core import (
    AppError,
    Generation,
    GenerationSettings,
    Studio,
    rerouted_summary,
    side_by_side,
)
from app.generation import never_active
from app.messages import guarded, ok, problem
from app.panels import (  # CardPanel: app/ui.py reads the card's outputs here
    CardPanel,
    ClearPanel,
    GenerationPanel,
    PendingPanel,
    RestorePanel,
    TokenPanel,
    skipped,
)
from app.session import Session

logger = logging.getLogger(__name__)

PROMPT = "prompt"  # the run that names a prompt token: what the model expected there, from the text before it
RUNS = ("original", "intervened", PROMPT)
CHANGED = "changed by intervention"
NEWLINE = "⏎\n"  # a line break inside a token: a mark to click, then the break itself (the page keeps it)
# "relevance": a semantic search by similarity, a label search exact matches first; without a search, activations
ORDERINGS = {"relevance": None, "activation count": "activation_count", "label score": "label_score",
             "prototype id": "prototype_id"}
TABLE_HEADERS = ["id", "label", "category", "label score", "sibling score", "tokens", "similarity"]
TABLE_WIDTHS = ["44px", "200px", "110px", "82px", "82px", "70px", "110px"]  # every number on screen at 1280 px
SEMANTIC_MIN = 0.40  # a semantic match: cosine similarity of the query and the label at least this (MiniLM)
N_NEAREST = 10  # shown, with their similarity, when no prototype reaches SEMANTIC_MIN
PUSHES = "pushes token"  # the search mode "who pushes token X"
N_PUSHERS = 50
ACTIVE_HEADERS = ["id", "label: fires on → pushes toward", "category", "activation", "contribution"]
INTERVENTION_HEADERS = ["#", "intervention", "prototype ids"]
CONTROLLER_HEADERS = ["direction", "prototype_id", "factor", "label", "category", "evidence"]


def _highlights(studio: Studio, gen: Generation | None, diff_status: list[str] | None = None) -> list:
    """HighlightedText value: each generated token with its top prototype's category (or 'changed')."""
    if gen is None:
        return []
    out = []
    for i, step in enumerate(gen.steps):
        label = studio.top_category(step)
        if diff_status is not None and diff_status[i] in ("first change", "changed"):
            label = CHANGED
        out.append((step.text.replace("\r\n", "\n").replace("\n", NEWLINE), label))
    return out


def _generation_json(gen: Generation | None) -> dict | None:
    if gen is None:
        return None
    return {"prompt": gen.prompt_text, "text": gen.text, "notes": gen.notes,
            "interventions": {"suppress": sorted(gen.interventions.suppress),
                              "suppress_mode": gen.interventions.suppress_mode,
                              "scale": {str(p): f for p, f in gen.interventions.scale.items()},
                              "controller": None if gen.interventions.controller is None else
                              app_controllers.name(gen.interventions.controller)},
            "tokens": [{"index": i, "token_id": s.token_id, "text": s.text, "logit": s.logit,
                        "prototype_ids": s.prototype_ids, "activations": s.activations,
                        "rerouted_ids": s.rerouted_ids}
                       for i, s in enumerate(gen.steps)]}


# ----------------------------------------------------------------------------------------------------------------
# Handlers: generation and tokens.


# Stop's answer and the generation's last updates run in different threads: the few lines that decide which of
# them writes the stopped text hold this lock (one for all sessions: each holds it for a few assignments)
_STOP_LOCK = threading.Lock()


class RunControl:
    """One browser session's Stop button (a mutable value in its own gr.State, never shared between sessions): Stop
    asks the running generation to end after its current token, and the generation itself writes the last
    update. Cancelling the event instead lets updates already on their way land after the 'stopped' message.

    The page numbers a run when Generate is clicked (announce, outside the queue), so a Stop pressed while the run
    still waits for the model reaches it. Stop also sends how many tokens each column shows: the run keeps at most
    one more, however far the model had run ahead of the page (tokens on their way are dropped, not shown).

    A run that has written all its tokens records them (finish) before its last update leaves, so a Stop that
    arrives from then on (the page lagging behind the stream) cuts them, in its own answer and, when the run has
    not ended yet, in one more update of the run (late_cut): whichever of the two lands last, the page ends cut."""

    def __init__(self) -> None:
        self.run = 0
        self.announced = False
        self.stop_run = -1
        self.keep: dict[str, int] = {}
        # (run, {column: text}, the columns it streamed, the intervened column's title) of the last finished run
        self.finished: tuple[int, dict, list[str], str] | None = None
        self.cut: tuple[int, dict] | None = None  # (run, {column: text as a late Stop cut it})

    def announce(self) -> int:
        """Generate was clicked: the run it queues gets its number now."""
        self.run += 1
        self.announced = True
        return self.run

    def start(self) -> int:
        """The generation begins: the announced run, or a new one (an API call announces nothing)."""
        if not self.announced:
            self.run += 1
        self.announced = False
        return self.run

    def stop(self, shown: dict | None = None) -> None:
        """Stop the current run; shown: {column: tokens the page shows} when the page says."""
        self.keep = {name: max(0, int(n)) + 1 for name, n in (shown or {}).items()}
        self.stop_run = self.run

    def stopped(self, run: int) -> bool:
        return self.stop_run == run

    def finish(self, run: int, texts: dict, streamed: list[str], column: str) -> dict | None:
        """Run `run` has written all it will (texts: {column: Generation}; it streamed the columns `streamed`),
        just before its last update. None when it was not stopped; else, a Stop having come since its last look,
        the texts cut to what that Stop may keep."""
        with _STOP_LOCK:
            if self.stopped(run):
                return {name: self.kept(name, gen) if name in streamed else gen for name, gen in texts.items()}
            self.finished = (run, dict(texts), list(streamed), column)
            return None

    def late_stop(self, shown: dict | None) -> tuple[dict, str] | None:
        """Stop pressed: ask the current run to end (stop), and when that run has already written all its tokens
        (the page lagged behind it), ({column: text cut to what the page showed plus one}, the column title) for
        the caller to write. None when there is nothing to cut."""
        with _STOP_LOCK:
            self.stop(shown)
            done = self.finished
            if done is None or done[0] != self.run or not self.keep:
                return None
            self.finished = None  # a second Stop cuts nothing more
            run, texts, streamed, column = done
            cut = {name: self.kept(name, gen) if name in streamed else gen for name, gen in texts.items()}
            if all(cut[name] is texts[name] for name in streamed):
                return None  # the page already shows the whole text: nothing to stop
            self.cut = (run, cut)
            return cut, column

    def late_cut(self, run: int) -> dict | None:
        """The texts a late Stop cut from run `run` (asked by the run after its last update), else None."""
        with _STOP_LOCK:
            return self.cut[1] if self.cut is not None and self.cut[0] == run else None

    def kept(self, name: str, gen: Generation | None) -> Generation | None:
        """gen cut to the tokens the stopped run may keep in column `name`."""
        most = self.keep.get(name)
        if gen is None or most is None or len(gen.steps) <= most:
            return gen
        return replace(gen, steps=gen.steps[:most], finished=False)  # a cut text is never reused as whole


def _settings(studio: Studio, prompt, max_new_tokens, temperature, top_p, seed) -> GenerationSettings:
    """The page's controls as checked settings (AppError with a short message for anything out of range)."""
    return studio.check_settings(GenerationSettings(prompt=prompt if prompt is not None else "",
                                                    max_new_tokens=max_new_tokens, temperature=temperature,
                                                    top_p=top_p, seed=seed))


@guarded
def generate(studio: Studio, prompt: str, max_new_tokens: float, temperature: float, top_p: float, seed: float,
             session: Session, control: RunControl | None = None, session_hash: str | None = None):
    """Stream the original continuation and, when the session has interventions, the intervened one beside it
    (same settings and seed). Yields GenerationPanel (both texts, status, the intervened column's title, session,
    result): the
    session already holds the growing texts, so a token can be explained while the rest is written; after
    control.stop() the run ends after the current token and keeps what it wrote. With the page's session_hash the
    generation is admitted by its cost (limits.generation_cost against the session's CostBudget)."""
    run = control.start() if control is not None else None
    stopped = False
    try:
        settings = _settings(studio, prompt, max_new_tokens, temperature, top_p, seed)
        interventions = session.interventions()
        reuse = session.original is not None and session.original.finished and \
            session.original.settings == settings
        if session_hash:
            ids, max_new, _ = studio.encode_prompt(settings)
            cost = limits.generation_cost(len(ids), max_new, int(not reuse) + int(not interventions.is_empty))
            wait = studio.budget.spend(session_hash, cost)
            if wait > 0:
                raise AppError(f"this page has used its share of the model for now: wait {math.ceil(wait)} s (this "
                               f"generation costs {cost:.0f} units of {studio.limits.cost_burst:.0f}; fewer new "
                               "tokens or a shorter prompt cost less)")
        streams = []
        if not reuse:
            streams.append(("original", studio.stream(settings)))
        if not interventions.is_empty:
            streams.append(("intervened", studio.stream(settings, interventions)))
        current = {"original": session.original if reuse else None, "intervened": None}
        column = _intervened_column(session if not interventions.is_empty else None)
        active = list(streams)
        while active:
            if control is not None and control.stopped(run):
                stopped = True
                for name, _ in streams:
                    current[name] = control.kept(name, current[name])
                break
            wrote = False
            for name, stream in list(active):
                gen = next(stream, None)
                if gen is None:
                    active.remove((name, stream))
                    continue
                current[name], wrote = gen, True
            if not wrote:
                break  # every stream ended: the last update follows
            status = _generation_status(studio, current)
            session = replace(session, original=current["original"], intervened=current["intervened"],
                              selected=None)
            yield GenerationPanel(_highlights(studio, current["original"]), _highlights(studio, current["intervened"]),
                                  status, column, session, None)
    except AppError as err:
        yield GenerationPanel([], [], problem(err), INTERVENED_TITLE, session, None)
        return
    original, intervened = current["original"], current["intervened"]
    if original is None and not stopped:  # nothing streamed: the stored original is reused, no interventions
        original = session.original
    if control is not None and not stopped:
        # all written: from here a Stop cuts these texts (RunControl.finish), also one that came after the loop's
        # last look
        cut = control.finish(run, {"original": original, "intervened": intervened},
                             [name for name, _ in streams], column)
        if cut is not None:
            original, intervened, stopped = cut["original"], cut["intervened"], True
    yield _final_panel(studio, original, intervened, column, session, stopped)
    if control is not None and not stopped:
        late = control.late_cut(run)
        if late is not None:  # a Stop came while the last update was on its way: it must not be the last word
            yield _final_panel(studio, late["original"], late["intervened"], column, session, stopped=True)


def _final_panel(studio: Studio, original: Generation | None, intervened: Generation | None, column: str,
                 session: Session, stopped: bool) -> GenerationPanel:
    """A run's last update: both texts, their comparison, the status line and the session holding them."""
    diff = side_by_side(original, intervened) if original is not None and intervened is not None else None
    session = replace(session, original=original, intervened=intervened, selected=None)
    marks = diff.status if diff else None
    return GenerationPanel(_highlights(studio, original), _highlights(studio, intervened, marks),
                           _generation_status(studio, {"original": original, "intervened": intervened}, diff,
                                              done=True, stopped=stopped), column, session,
                           _result(original, intervened, diff))


def _result(original: Generation | None, intervened: Generation | None, diff=None) -> dict:
    """What /generate returns as data: both texts with their tokens and the per-token comparison."""
    return {"original": _generation_json(original), "intervened": _generation_json(intervened),
            "first_change": diff.first_change if diff else None, "status": diff.status if diff else None}


INTERVENED_TITLE = "**With your interventions** (same seed; add some on the right)"


def _intervened_column(session: Session | None) -> str:
    """The right column's title names what the intervened text applies."""
    applied = session.applied() if session is not None else ""
    return f"**With: {html.escape(applied)}** (same seed)" if applied else INTERVENED_TITLE


# Stop's page-side half: how many tokens each column shows at the click (HighlightedText draws one .token each)
STOP_JS = """(control, shown, session) => {
    const count = (id) => document.querySelectorAll(`#${id} .textfield .token`).length;
    return [control, JSON.stringify({original: count("original"), intervened: count("intervened")}), session];
}"""


def _shown_counts(shown: str | None) -> dict | None:
    """STOP_JS's JSON {column: tokens on the page} as ints, or None when the page said nothing usable."""
    if not shown or len(shown) > 200:
        return None
    try:
        parsed = json.loads(shown)
        return {k: parsed[k] for k in ("original", "intervened")
                if isinstance(parsed.get(k), int) and not isinstance(parsed.get(k), bool)}
    except (ValueError, TypeError, AttributeError):
        return None


@guarded
def request_stop(studio: Studio, control: RunControl, shown: str | None = None, session: Session | None = None):
    """Stop: the running generation of this session ends after its current token (it writes the last update) and
    keeps at most one token more per column than `shown` (JSON {column: tokens on the page}, from STOP_JS).

    A page under load can lag behind the server's stream: when Stop arrives after the run has written all its
    tokens, the text it streamed is cut here to what the page showed plus one, and this answer writes the columns
    (the status says 'Stopped'; RunControl.late_stop). Otherwise every field is left as it is (GenerationPanel of
    gr.skip)."""
    late = control.late_stop(_shown_counts(shown))
    if late is None or session is None:
        return skipped(GenerationPanel)
    cut, column = late
    return _final_panel(studio, cut["original"], cut["intervened"], column, session, stopped=True)


def _generation_status(studio: Studio, current: dict, diff=None, done: bool = False, stopped: bool = False) -> str:
    parts = []
    gen = current["original"] or current["intervened"]
    if stopped and gen is None:
        return "⏹ Stopped before the first token."
    if gen is not None:
        parts += [f"ℹ️ {note}" for note in gen.notes]
        counts = " and ".join(f"{len(g.steps)} {name}" for name, g in current.items() if g is not None)
        if stopped:
            parts.append(f"⏹ Stopped after {counts} token(s); what was written stays and can be explained.")
        else:
            parts.append(f"Generated {counts} token(s)." if done else f"Generating… {counts} token(s) so far.")
    if not done and not stopped:  # while streaming the status is short: each update resends it whole
        return "  \n".join(parts)
    if current["intervened"] is None:
        parts.append("Click a token to see why; change prototypes on the right, then generate again to compare.")
    elif diff is not None:
        if diff.first_change is None:
            parts.append("The interventions did not change this continuation.")
        else:
            n = sum(s in ("first change", "changed") for s in diff.status)
            parts.append(f"The interventions changed {n} token(s), first at token {diff.first_change}. Click a "
                         f"highlighted token on the right to see which prototypes changed it.")
        brought_in = rerouted_summary(current["intervened"])
        if brought_in:
            parts.append("Re-routed: the suppressed prototypes' slots went to " + ", ".join(
                f"#{pid} {html.escape(studio.label(pid)[0] or '(no label)')} ({n} token(s))"
                for pid, n in brought_in) + ".")
        idle = never_active(current["intervened"], current["intervened"].interventions.scale)
        if idle:
            parts.append("Scaled but never active in this text, so scaling changed nothing there: " + ", ".join(
                f"#{pid}" for pid in idle[:10]) + (" ..." if len(idle) > 10 else "") + ". To add a prototype where "
                "the model does not select it, inject it (its card: Activation, then Inject).")
    return "  \n".join(parts)


@guarded
def select_original(evt: gr.SelectData):
    """A click on a token of the original text -> (run, index) for decompose."""
    return "original", int(evt.index)


@guarded
def select_intervened(evt: gr.SelectData):
    """A click on a token of the intervened text -> (run, index) for decompose."""
    return "intervened", int(evt.index)


@guarded
def select_prompt(evt: gr.SelectData):
    """A click on a prompt token -> (run, index) for decompose."""
    return PROMPT, int(evt.index)


PROMPT_FIRST = "first token: nothing before it"
PROMPT_TOKEN = "prompt"


def prompt_tokens(studio: Studio, session: Session | None) -> list:
    """HighlightedText value: the prompt the original text continued, token by token, each clickable; the first
    is marked (no text comes before it to predict it from)."""
    gen = None if session is None else session.original
    if gen is None:
        return []
    return [(studio.decode(t).replace("\r\n", "\n").replace("\n", NEWLINE), PROMPT_TOKEN if i else PROMPT_FIRST)
            for i, t in enumerate(gen.prompt_ids)]


def _text_of(session: Session, run) -> Generation:
    """The session's original or intervened text, as the page names it (for 'prompt' the original, whose prompt
    the plain model reads); AppError when it has none."""
    if run not in RUNS:
        raise AppError(f"run must be 'original', 'intervened' or 'prompt', got {limits.shown(run)}")
    gen = session.intervened if run == "intervened" else session.original
    if gen is None:
        raise AppError("there is no intervened text: add an intervention and generate again" if
                       run == "intervened" else "generate first")
    return gen


@guarded
def decompose(studio: Studio, run: str, index: float, session: Session):
    """The explanation of one generated token (TokenPanel: waterfall, alternatives, summary, active prototypes, the
    top prototype's id to open its card, session, the data as JSON), from one call into the library."""
    try:
        gen = _text_of(session, run)
        view = studio.explain(gen, index, original=session.original if run == "intervened" else None,
                              in_prompt=run == PROMPT)
    except AppError as err:
        empty = plots.empty_figure(str(err))
        return TokenPanel(empty, empty, problem(err), [], None, session, None)
    why = view.why
    session = replace(session, selected=(run, view.index))
    rows = [[s.prototype_id, s.label, s.category, round(s.activation, 4), round(s.contribution, 4)]
            for s in view.chosen.slices]
    top = view.chosen.slices[0].prototype_id if view.chosen.slices else None
    data = view.as_dict()
    data["why_changed"] = why.as_dict() if why else None
    return TokenPanel(plots.decomposition_figure(view.chosen, view.carried), plots.alternatives_figure(view),
                      render.token_summary(view, why), rows, top, session, data)


@guarded
def contrast(studio: Studio, run: str, index, other, session: Session):
    """Why the explained token and not `other` (a token typed as text) at the same position: (figure, summary,
    data). The gap between their logits splits exactly into the residual's part and one part per prototype."""
    try:
        c, note = studio.contrast(_text_of(session, run), index, other, in_prompt=run == PROMPT)
    except AppError as err:
        return plots.empty_figure(str(err)), problem(err), None
    a, b = studio.decode(c.token_a), studio.decode(c.token_b)
    share = "" if c.token_a == c.token_b else f" (the prototypes carry {100 * c.share:.0f}% of it" + (
        ", the two pull opposite ways)" if not 0 <= c.share <= 1 else ")")
    qa, qb = html.escape(repr(a)), html.escape(repr(b))

    def side(which: str, token: str) -> str:
        parts = c.favouring(which)[:5]
        return f"for {token}: " + ", ".join(f"#{p} {v:+.3f}" for p, v in parts) if parts else \
            f"no prototype favours {token}"

    md = (f"**Why {qa} and not {qb}:** logit gap {c.margin:+.4f} = residual {c.residual:+.4f} + prototypes "
          f"{c.prototypes:+.4f}{share}. {side('a', qa)[0].upper()}{side('a', qa)[1:]}; {side('b', qb)}."
          + (f"  \nℹ️ {note}" if note else ""))
    labels = {p: studio.label(p)[0] for p in c.prototype_ids}
    return plots.contrast_figure(c, a, b, labels), md, c.as_dict()


@guarded
def clear_explanation(control: RunControl | None = None):
    """A new generation empties the explanation panel: it described a token of the previous text (ClearPanel). It
    runs outside the queue, before the generation starts, so the old explanation is gone at once; it also numbers
    the run (RunControl.announce), so Stop reaches a run still waiting in the queue."""
    if control is not None:
        control.announce()
    empty = plots.empty_figure("click a token of the new text")
    return ClearPanel(empty, empty, "Click a token of the new text to explain it.", [], None, EMPTY_ATTRIBUTION,
                      None, "Generating…")


@guarded
def attribute(studio: Studio, run: str, index, session: Session, reading="gradient"):
    """The training-data panel for one generated token (app/attribution.py), read as `reading` says ('gradient',
    'token' or 'sequence'): (html, data)."""
    return attribution_panel(studio, run, index, session, reading)


@guarded
def refresh_attribution(studio: Studio, token: dict | None, run: str, index, session: Session,
                        reading="gradient"):
    """The training-data panel follows the explained token and the chosen reading; with no token explained it is
    empty."""
    if not token:
        return EMPTY_ATTRIBUTION, None
    return attribution_panel(studio, run, index, session, reading)


# ----------------------------------------------------------------------------------------------------------------
# Handlers: prototype cards, search, the map.


def _score(x) -> float | None:
    return None if x is None else round(float(x), 3)


@guarded
def search(studio: Studio, text: str, mode: str, category: str, order: str):
    """The browser table: all prototypes (empty search) or label / semantic search results, filtered by
    category and sorted (relevance by default). A semantic match is a prototype whose label (with its category and
    topic), predicted tokens or evidence has cosine similarity >= SEMANTIC_MIN; the count is the number of matches.
    When none passes, the N_NEAREST nearest are listed with their similarity and the status says so, instead of an
    empty table. Returns (rows, status)."""
    try:
        text = limits.text("the search", text, 100_000)
        category = limits.text("the category", category, 1_000) if not isinstance(category, str | None) else category
        category = None if category in (None, "", "all") else category
        if not isinstance(order, str) or order not in ORDERINGS:
            raise AppError(f"sort by one of {', '.join(ORDERINGS)}, got {limits.shown(order)}")
        listed = studio.need_db().table(category, "prototype_id")
        if not (text or "").strip():
            rows = [{**r, "similarity": None} for r in listed]
            found = f"{len(rows)} prototype(s)" + (f" in {category}" if category else "")
        elif mode == PUSHES:  # who pushes token X: the signature's entry for the token, strongest first
            token, pushing, note = studio.pushers(text, top=N_PUSHERS)
            by_id = {r["prototype_id"]: r for r in listed}
            rows = [{**by_id[p], "similarity": v} for p, v in pushing if p in by_id]
            found = ((f"{note}. " if note else "") + f"the {len(rows)} prototype(s) whose signature raises "
                     f"{token!r} most (last column: the slice each adds to its logit at activation 1)"
                     + (f" in {category}" if category else ""))
        else:
            kind = "semantic" if mode == "semantic" else "label"
            results = studio.need_db().search(text, kind, k=studio.n_prototypes)
            by_id = {r["prototype_id"]: r for r in listed}
            results = [r for r in results if r["prototype_id"] in by_id]
            nearest = False
            if kind == "semantic":
                matches = [r for r in results if r["score"] >= SEMANTIC_MIN]
                nearest = not matches and bool(results)
                results = matches or results[:N_NEAREST]  # nothing passes: the nearest, with their similarity
            rows = [{**by_id[r["prototype_id"]], "similarity": r["score"] if kind == "semantic" else None}
                    for r in results]  # search order = relevance
            where = f" in {category}" if category else ""
            if nearest:
                found = (f"no prototype{where} has similarity >= {SEMANTIC_MIN:.2f} to {text.strip()[:80]!r} "
                         f"(label, topic or predicted tokens); the {len(rows)} nearest, with their similarity")
            else:
                what = (f"with similarity >= {SEMANTIC_MIN:.2f} (label, topic or predicted tokens) to"
                        if kind == "semantic" else "whose label contains")
                found = f"{len(rows)} prototype(s) {what} {text.strip()[:80]!r}{where}"
        key = ORDERINGS[order]
        if key is None and not (text or "").strip():
            key = "activation_count"
        if key == "prototype_id":
            rows.sort(key=lambda r: r["prototype_id"])
        elif key is not None:
            rows.sort(key=lambda r: (r.get(key) is None, -(r.get(key) or 0), r["prototype_id"]))
        out = [[r["prototype_id"], r["label"], r["category"], _score(r.get("label_score")),
                _score(r.get("sibling_score")), r.get("activation_count"), _score(r["similarity"])] for r in rows]
        return out, f"{found}, sorted by {order}"
    except AppError as err:
        return [], problem(err)


@guarded
def map_plot(studio: Studio, text: str = "", table=None, card: dict | None = None, category: str | None = None):
    """The map: the search results in the table ringed (when there is a search), the open card's prototype
    starred, other categories greyed out when the filter names one."""
    try:
        highlight = set()
        if isinstance(text, str) and text.strip() and table is not None:
            if hasattr(table, "iloc"):
                ids = table.iloc[:, 0].tolist() if table.shape[1] else []
            else:  # rows as the API sends them: anything that is not a row of cells is ignored
                ids = [r[0] for r in (table if isinstance(table, list) else []) if isinstance(r, list | tuple) and r]
            highlight = {int(i) for i in ids if str(i).strip().lstrip("-").isdigit() and len(str(i)) < 12}
        selected = card.get("prototype_id") if isinstance(card, dict) else None
        selected = selected if isinstance(selected, int) and not isinstance(selected, bool) else None
        category = category if isinstance(category, str) and category not in ("", "all") else None
        return plots.map_figure(studio.need_db().map_points(), highlight, selected, category)
    except AppError as err:
        return plots.empty_figure(str(err))


def _linked_prototype(request: gr.Request | None) -> int | None:
    raw = request.query_params.get("prototype") if request is not None else None
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


@guarded
def deep_link(request: gr.Request):
    """?prototype=ID opens that prototype's card and the browser tab. Without a link the id box and the tabs are left
    alone: the page's load event can land after the user has typed an id or switched tab, and must not undo that."""
    pid = _linked_prototype(request)
    if pid is None:
        return gr.skip(), gr.skip()
    return pid, gr.Tabs(selected="browse")


def deep_link_card(studio: Studio, prototype_id, request: gr.Request = None):
    """The card a ?prototype=ID link opens (CardPanel); without a link the card on screen stays as it is."""
    if _linked_prototype(request) is None:
        return skipped(CardPanel)
    return prototype(studio, prototype_id)


# ----------------------------------------------------------------------------------------------------------------
# Handlers: links, exports and imports (app/share.py, app/export.py).


def _base_url(request: gr.Request | None) -> str:
    """The page's address as the browser (or the proxy in front of the app) sees it."""
    headers = {k.lower(): v for k, v in dict(getattr(request, "headers", None) or {}).items()}
    host = headers.get("x-forwarded-host") or headers.get("host") or "127.0.0.1:7860"
    scheme = headers.get("x-forwarded-proto") or ("https" if host.endswith(".hf.space") else "http")
    return f"{scheme.split(',')[0].strip()}://{host.split(',')[0].strip()}/"


@guarded
def share_link(studio: Studio, prompt: str, max_new_tokens: float, temperature: float, top_p: float, seed: float,
               run: str, token: dict | None, session: Session, request: gr.Request = None):
    """A URL restoring the prompt, settings, seed, interventions and the explained token. Returns (url, status)."""
    try:
        settings = _settings(studio, prompt, max_new_tokens, temperature, top_p, seed)
        ids, _, _ = studio.encode_prompt(settings)  # the same checks as Generate: a link restores something usable
        selected = None
        if isinstance(token, dict) and token.get("index") is not None and run in RUNS:
            low, high = (1, len(ids) - 1) if run == PROMPT else (0, settings.max_new_tokens - 1)
            selected = (run, limits.whole("the explained token's index", token["index"], low, high))
        link = share.encode_link(studio, settings, session, selected)
        share.decode_link(studio, link)  # opened by the same rules it was made by: a link it gives always opens
        url = f"{_base_url(request)}?{share.PARAM}={link}"
    except (AppError, TypeError, ValueError) as err:
        return "", problem(err)
    notes = [] if session.controller is None or session.controller_name else [
        " The loaded controller is not a shipped one, so the link leaves it out."]
    return url, ok("Link copied (also shown here): opening it restores the prompt, settings, interventions"
                    + (" and the explained token" if selected else "") + " and generates again." + "".join(notes))


@guarded
def restore_link(studio: Studio, session: Session, request: gr.Request = None):
    """On page load with ?state=...: fill the settings and interventions from the link (or say why it cannot be
    used, and apply nothing). Returns RestorePanel (the settings, session, interventions, the pending restore and
    the generation status)."""
    token = dict(getattr(request, "query_params", None) or {}).get(share.PARAM)
    if not token:
        return skipped(RestorePanel)
    try:
        link = share.decode_link(studio, token)
    except AppError as err:
        return skipped(RestorePanel)._replace(
            pending=None, gen_status=problem(f"This link cannot be used: {err}. Nothing from it was applied."))
    s = link.settings
    restored = replace(link.session, original=None, intervened=None, selected=None)
    pending = {"selected": list(link.selected) if link.selected else None}
    return RestorePanel(s.prompt, s.max_new_tokens, s.temperature, s.top_p, s.seed, restored, restored.rows(),
                        ok(f"restored {restored.n_rows} intervention(s) from the link"), restored.suppress_mode,
                        pending, "Restoring a shared link: generating…")


@guarded
def generate_pending(studio: Studio, pending: dict | None, prompt, max_new_tokens, temperature, top_p, seed,
                     session: Session, session_hash: str | None = None, control: RunControl | None = None):
    """Generate after a restored link; nothing (skips) otherwise."""
    if not pending:
        yield skipped(GenerationPanel)
        return
    yield from generate(studio, prompt, max_new_tokens, temperature, top_p, seed, session, control,
                        session_hash=session_hash)


@guarded
def select_pending(studio: Studio, pending: dict | None, session: Session):
    """Explain the token a restored link selected, and open its top prototype's card; nothing otherwise
    (PendingPanel: run, index, the TokenPanel fields, the CardPanel fields)."""
    selected = (pending or {}).get("selected")
    if not selected:
        return skipped(PendingPanel)
    run, index = selected
    token = decompose(studio, run, index, session)
    return PendingPanel(run, index, *token, *prototype(studio, token.proto_id))


def _export(make, *args):
    """(the file or None on a problem, status)."""
    try:
        path = make(*args)
    except AppError as err:
        return None, problem(err)
    return path, ok(f"ready: {Path(path).name} (download below)")


def link_stale(link: str | None):
    """The state changed after a link was made: clear it (and say so) rather than leave a link to an older state on
    screen. No link shown: nothing changes. Returns (link box, share status)."""
    if not link:
        return gr.update(), gr.update()
    return gr.update(value="", visible=False), ("The link was for an earlier state and has been cleared; press "
                                                "Copy link again for this one.")


def _shown_if_set(value):
    """The link box and the download boxes take no room until they hold something."""
    return gr.update(visible=bool(value))


@guarded
def export_generation(studio: Studio, session: Session):
    """Both texts with every token's decomposition, as JSON. Returns (file, status)."""
    return _export(export.export_generation, studio, session)


@guarded
def export_interventions(studio: Studio, session: Session):
    """The interventions as JSON (Import reads it back). Returns (file, status)."""
    return _export(export.export_interventions, studio, session)


@guarded
def export_table(studio: Studio):
    """Every prototype with its label, category, scores and stats, as CSV. Returns (file, status)."""
    return _export(export.export_table, studio)


@guarded
def export_evidence(studio: Studio, prototype_id):
    """One prototype's evidence rows as CSV. Returns (file, status)."""
    return _export(export.export_evidence, studio, prototype_id)


@guarded
def import_interventions(studio: Studio, upload, session: Session):
    """Replace the session's interventions with those of an exported file. Returns (session, rows, status, mode)."""
    try:
        name = upload if isinstance(upload, str) else getattr(upload, "name", None)
        if not upload or not isinstance(name, str) or not name:
            raise AppError("choose an interventions file (Export interventions writes one)")
        path = Path(limits.text("the file's name", name, 4096))
        if path.stat().st_size > share.MAX_JSON_BYTES:
            raise AppError("this file is too large to be an interventions file")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            raise AppError("this file is not an interventions file (not JSON, or nested too deeply)") from None
        session = share.import_interventions(studio, data, session)
    except AppError as err:
        return session, session.rows(), problem(err), gr.skip()
    except (OSError, ValueError):  # the upload vanished or cannot be read: say so without its server path
        return session, session.rows(), problem("the uploaded file could not be read: upload it again"), gr.skip()
    return session, session.rows(), ok(f"imported {session.n_rows} intervention(s). Generate again "
                                                       "to compare."), session.suppress_mode
