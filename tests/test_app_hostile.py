"""Every handler behind an endpoint against a table of hostile inputs, one argument at a time (the others valid):
each answer is a short message, never an unexpected exception (the guard's "Something went wrong", or anything
logged with a traceback), never a long input echoed back, and the session a refused call returns is the one it got.
"""

from __future__ import annotations

import json
import logging
import math
from types import SimpleNamespace

import gradio as gr
import pytest
from test_app_support import shared_assets

from app import handlers, interventions, share, ui
from app.core import GenerationSettings, Studio
from app.messages import MAX_MESSAGE_CHARS
from app.session import Session, suppress_item
from app.tools import TOOLS

PROMPT = "the cat sat on the"
LONG = "x" * 60_000
NESTED = "[" * 100_000 + "]" * 100_000  # parses only with unbounded recursion
HOSTILE = [None, "", LONG, "\ud800", float("inf"), float("-inf"), float("nan"), -1, 10**30, 2.5, True, [], {},
           [[1, 2]], {"index": float("inf")}, {"prototype_id": "x"}, "1e309", "-0", " 3 "]


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    model, db = shared_assets(tmp_path_factory)
    return Studio.load(model, db)


@pytest.fixture(scope="module")
def session(studio):
    """A session with a generation, a token explained and one intervention: what a hostile call must not change."""
    s = Session().add(suppress_item(1))
    *_, s, _ = list(handlers.generate(studio, PROMPT, 4, 0, 1, 0, s))[-1]
    return s


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _strings(v)]
    return []


def _call(fn, args, caplog):
    """The handler's answer (a generator's last), or the message of the gr.Error the guard raised."""
    caplog.clear()
    try:
        out = fn(*args)
        if hasattr(out, "__next__"):
            out = list(out)[-1] if out is not None else None
    except gr.Error as err:
        out = gr.Error(err.message)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    return out, errors


def _check(name, out, errors, session):
    assert not errors, f"{name}: logged {errors[0].getMessage()[:200]}"
    if isinstance(out, gr.Error):
        message = out.message
        assert "Something went wrong" not in message, f"{name}: an unexpected exception"
        assert 0 < len(message) <= MAX_MESSAGE_CHARS, f"{name}: {message[:80]!r}"
        texts = [message]
    else:
        texts = _strings(out)
        for text in texts:
            if text.startswith("⚠️"):
                assert len(text) <= MAX_MESSAGE_CHARS + 3, f"{name}: a {len(text)}-character message"
        sessions = [v for v in (out if isinstance(out, tuple) else [out]) if isinstance(v, Session)]
        refused = any(t.startswith("⚠️") for t in texts)
        if refused and sessions:
            assert sessions[0] == session, f"{name}: a refused call changed the session"
    assert not any(LONG[:1000] in t for t in texts), f"{name}: the long input was echoed back"


def _cases(studio, session, tmp_path):
    """(name, handler, valid arguments) for every endpoint that takes user input."""
    upload = tmp_path / "interventions.json"
    upload.write_text(json.dumps(share.interventions_json(studio, session)))
    token = {"index": 0}
    tool = {f.api_name: f.fn for f in ui.build_demo(studio).fns.values() if f.api_name in TOOLS}
    return [
        ("generate", lambda *a: handlers.generate(studio, *a), [PROMPT, 4, 0, 1, 0, session]),
        ("decompose", lambda *a: handlers.decompose(studio, *a), ["original", 1, session]),
        ("prototype", lambda *a: handlers.prototype(studio, *a), [3]),
        ("try_prototype", lambda *a: handlers.try_text(studio, *a), [3, PROMPT]),
        ("contrast", lambda *a: handlers.contrast(studio, *a), ["original", 1, " the", session]),
        ("search", lambda *a: handlers.search(studio, *a), ["the", "label", "all", "relevance"]),
        ("map", lambda *a: handlers.map_plot(studio, *a), ["the", [[1, "a"]], {"prototype_id": 2}, "all"]),
        ("attribute", lambda *a: handlers.attribute(studio, *a), ["original", 1, session, "token"]),
        ("link", lambda *a: handlers.share_link(studio, *a), [PROMPT, 4, 0, 1, 0, "original", token, session]),
        ("export_evidence", lambda *a: handlers.export_evidence(studio, *a), [3]),
        ("import", lambda *a: handlers.import_interventions(studio, *a), [str(upload), session]),
        ("suppress", lambda *a: interventions.suppress(studio, *a), [3, session]),
        ("scale", lambda *a: interventions.scale(studio, *a), [3, 2.0, session]),
        ("suppress_category", lambda *a: interventions.suppress_category(studio, *a),
         [studio.db.categories[0], session]),
        ("suppress_search", lambda *a: interventions.suppress_search(studio, *a), ["the", "label", session]),
        ("preset", lambda *a: interventions.apply_preset(studio, *a), ["kjv-register", session]),
        ("suppress_mode", interventions.suppress_mode, ["zero", session]),
        ("remove_intervention", interventions.remove_intervention, [0, session]),
        # the agents' tools (app/tools.py): everything in their arguments, no session
        ("generate_explained", tool["generate_explained"], [PROMPT, 3, [1], {"2": 1.5}, 0, 0]),
        ("explain_token", tool["explain_token"], [PROMPT, 1, 3, [1], None, 0, 0, 2]),
        ("search_prototypes", tool["search_prototypes"], ["the", "label", 5]),
        ("prototype_card", tool["prototype_card"], [3, 2]),
        ("compare_interventions", tool["compare_interventions"], [PROMPT, [1], None, 3, 0, 0]),
        ("training_data", tool["training_data"], [PROMPT, 1, 3, 0, 0, 3, "token"]),
    ]


def test_every_endpoint_answers_hostile_input_with_a_short_message(studio, session, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    tried = 0
    for name, fn, valid in _cases(studio, session, tmp_path):
        for position, original in enumerate(valid):
            if isinstance(original, Session):
                continue  # the session is the app's own gr.State, never sent by a client
            for value in HOSTILE:
                args = list(valid)
                args[position] = value
                out, errors = _call(fn, args, caplog)
                _check(f"{name}[{position}]={str(value)[:20]!r}", out, errors, session)
                tried += 1
    assert tried > 500


def test_hostile_files_and_links_are_refused_with_a_message(studio, session, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    for content in (NESTED, LONG, "\x00\xff", '{"format": "x"}', "[]", json.dumps({"a": [None] * 10})):
        path = tmp_path / "hostile.json"
        path.write_text(content, encoding="utf-8", errors="surrogateescape")
        out, errors = _call(lambda p: handlers.import_interventions(studio, p, session), [str(path)], caplog)
        _check("import file", out, errors, session)
        assert out[2].startswith("⚠️") and out[0] == session
    missing = tmp_path / "gone.json"
    out, errors = _call(lambda p: handlers.import_interventions(studio, p, session), [str(missing)], caplog)
    _check("import missing", out, errors, session)
    assert str(tmp_path) not in out[2]  # no server path in the message
    # a link whose prompt holds a lone surrogate, made as the app makes links: refused when opened
    settings = GenerationSettings("a \ud800 b", 4)
    link = share.encode_link(studio, settings, session)
    request = SimpleNamespace(query_params={share.PARAM: link}, headers={})
    restored, errors = _call(lambda: handlers.restore_link(studio, session, request), [], caplog)
    _check("surrogate link", restored, errors, session)
    assert "cannot be used" in restored.gen_status and restored.pending is None
    for token in ("a.b", "x" * 10_000, NESTED[:3000] + ".0", None, 5):
        request = SimpleNamespace(query_params={share.PARAM: token}, headers={})
        restored, errors = _call(lambda r=request: handlers.restore_link(studio, session, r), [], caplog)
        _check("bad link", restored, errors, session)


def test_every_link_the_app_gives_opens(studio, session, caplog):
    """Copy link answers either a link that restore_link opens, or a message: never a link the app refuses."""
    for prompt in (PROMPT, " " + PROMPT, PROMPT * 40, "ünïcödé ✓ " + PROMPT):
        for max_new in (1, 4, studio.limits.max_new_tokens):
            for token in (None, {"index": 0}, {"index": 3}, {"index": max_new + 5}):
                url, status = handlers.share_link(studio, prompt, max_new, 0.7, 0.9, 3, "intervened", token,
                                                  session)
                if not url:
                    assert status.startswith("⚠️") and len(status) <= MAX_MESSAGE_CHARS + 3
                    continue
                link = url.split(f"?{share.PARAM}=", 1)[1]
                request = SimpleNamespace(query_params={share.PARAM: link}, headers={})
                restored = handlers.restore_link(studio, session, request)
                assert restored.pending is not None, restored.gen_status
                assert restored.prompt == prompt and restored.max_new == max_new
                assert not math.isnan(restored.temperature)
