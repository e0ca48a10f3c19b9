"""Links, exports and imports (app/share.py, app/export.py, their handlers): a link or an interventions file
restores exactly the state it was made from (the same two texts come out), a damaged, edited or foreign one is
refused with a message and changes nothing, exported decompositions add up to the model's own logits, the CSVs
hold what the database holds. Also: a stopped generation keeps what it wrote and is never reused as finished."""

from __future__ import annotations

import base64
import hashlib
import json
import zlib
from dataclasses import replace

import gradio as gr
import pandas as pd
import pytest
import torch
from test_app_support import build_tiny_controller, changing_prototype, shared_assets

from app import export, handlers, interventions, share
from app.core import AppError, GenerationSettings, Studio
from app.session import Session, group_item, inject_item, scale_item, suppress_item

PROMPT = "the cat sat on the"


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    model, db = shared_assets(tmp_path_factory)
    return Studio.load(model, db)


def pack(data: dict) -> str:
    """A link token written independently of app/share.py: base64url(zlib(JSON)) '.' sha256[:16]."""
    raw = json.dumps(data).encode()
    return base64.urlsafe_b64encode(zlib.compress(raw)).decode().rstrip("=") + "." + \
        hashlib.sha256(raw).hexdigest()[:16]


def shown(value):
    """A handler's link or file, None when there is none (the page then keeps the box hidden)."""
    return handlers._shown_if_set(value)["visible"] and value or None


def request(**query) -> gr.Request:
    return gr.Request(query_params=query, headers={"host": "example.org:7860"})


def texts(studio, settings: GenerationSettings, session: Session) -> tuple[list[int], list[int] | None]:
    *_, result = list(handlers.generate(studio, settings.prompt, settings.max_new_tokens, settings.temperature,
                                     settings.top_p, settings.seed, session))[-1]
    ids = lambda run: None if run is None else [t["token_id"] for t in run["tokens"]]  # noqa: E731
    return ids(result["original"]), ids(result["intervened"])


@pytest.fixture(scope="module")
def state(studio):
    settings = GenerationSettings(PROMPT, max_new_tokens=8, temperature=0.9, top_p=0.95, seed=11)
    pid = changing_prototype(studio, replace(settings, temperature=0.0), "reroute")
    session = (Session().add(suppress_item(pid, studio.label(pid)[0])).add(scale_item((pid + 1) % 24, 2.5))
               .add(group_item("category", "a group", [(pid + 2) % 24, (pid + 3) % 24]))
               .add(inject_item((pid + 4) % 24, 1.5)).with_suppress_mode("zero"))
    return settings, session


def test_a_link_restores_settings_interventions_token_and_the_same_two_texts(studio, state):
    settings, session = state
    token = share.encode_link(studio, settings, session, ("intervened", 3))
    link = share.decode_link(studio, token)
    assert link.settings == settings and link.selected == ("intervened", 3)
    assert link.session.items == session.items and link.session.suppress_mode == "zero"
    assert link.session.interventions() == session.interventions()
    assert texts(studio, link.settings, link.session) == texts(studio, settings, session)

    # the handlers: the page's load event fills every control from ?state= and marks the restore as pending
    url, status = handlers.share_link(studio, settings.prompt, settings.max_new_tokens, settings.temperature,
                                settings.top_p, settings.seed, "intervened", {"index": 3}, session,
                                request(host="x"))
    url = shown(url)
    assert url.startswith("http://example.org:7860/?state=") and "⚠️" not in status
    out = handlers.restore_link(studio, Session(), request(state=url.split("state=")[1]))
    prompt, max_new, temperature, top_p, seed, restored, rows, _, mode, pending, _ = out
    assert (prompt, max_new, temperature, top_p, seed) == (PROMPT, 8, 0.9, 0.95, 11)
    assert restored.interventions() == session.interventions() and rows == session.rows() and mode == "zero"
    assert pending == {"selected": ["intervened", 3]}
    *_, restored, result = list(handlers.generate_pending(studio, pending, prompt, max_new, temperature, top_p, seed,
                                                      restored))[-1]
    picked = handlers.select_pending(studio, pending, restored)
    assert picked[:2] == ("intervened", 3) and picked[2 + 6]["index"] == 3  # decompose's data of token 3
    # no ?state=: every output is skipped, nothing is generated
    assert all(isinstance(o, type(gr.skip())) for o in handlers.restore_link(studio, Session(), request()))
    assert all(isinstance(o, type(gr.skip())) for o in next(handlers.generate_pending(studio, None, *[None] * 5,
                                                                              Session())))


def _valid(studio, state) -> dict:
    settings, session = state
    token = share.encode_link(studio, settings, session)
    body = token.split(".")[0]
    return json.loads(zlib.decompress(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))))


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["interventions"]["items"][0].update(prototype_ids=[24]), "ids 0..23"),
    (lambda d: d["interventions"]["items"][1].update(factor=99.0), "factor"),
    (lambda d: d["interventions"]["items"][0].update(kind="delete"), "kind"),
    (lambda d: d["interventions"]["items"][3].update(factor=0.0), "injected activation"),
    (lambda d: d["interventions"]["items"][3].update(factor=1e6), "injected activation"),
    (lambda d: d["interventions"]["items"][3].update(prototype_ids=[1, 2]), "single-prototype"),
    (lambda d: d["interventions"]["items"][0].update(path="/etc/passwd"), "not {kind"),
    (lambda d: d["interventions"].update(suppress_mode="explode"), "suppress_mode"),
    (lambda d: d["interventions"].update(controller="../../secret"), "controller"),
    (lambda d: d.update(temperature=float("nan")), "temperature"),
    (lambda d: d.update(max_new_tokens=100_000), "max_new_tokens"),
    (lambda d: d.update(prompt=""), "prompt"),
    (lambda d: d.update(selected={"run": "original", "index": 99}), "selected"),
    (lambda d: d.update(model="0" * 16), "another model"),
    (lambda d: d.update(extra=1), "fields"),
    (lambda d: d.update(v=2), "version"),
])
def test_an_edited_link_is_refused_with_a_reason(studio, state, edit, message):
    data = _valid(studio, state)
    edit(data)
    with pytest.raises(share.LinkError, match=message):
        share.decode_link(studio, pack(data))
    # through the page: a message in the status line, and every control left as it is
    out = handlers.restore_link(studio, Session(), request(state=pack(data)))
    assert all(isinstance(o, type(gr.skip())) for o in out[:9]) and out[9] is None
    assert "cannot be used" in out[10] and "Nothing from it was applied" in out[10]


@pytest.mark.parametrize("damage", [lambda t: t[:-1] + ("0" if t[-1] != "0" else "1"),  # checksum
                                    lambda t: t[: len(t) // 2],  # cut off
                                    lambda t: "A" + t[1:] if t[0] != "A" else "B" + t[1:],  # body
                                    lambda t: t.replace(".", ""), lambda t: "", lambda t: "%%%.zz"])
def test_a_damaged_link_is_refused(studio, state, damage):
    settings, session = state
    with pytest.raises(share.LinkError, match="changed or cut off"):
        share.decode_link(studio, damage(share.encode_link(studio, settings, session)))


def test_a_prototype_link_opens_its_card_and_no_link_leaves_the_id_box_and_card_alone(studio):
    """?prototype=ID fills the id box, opens the Prototypes tab and that prototype's card. Without a link (or with
    one that is not a number) the page's load event must not touch the id box or the card: it can land after the
    user has typed an id, and clearing it then made the next Suppress read an empty box."""
    pid = 5
    box, tab = handlers.deep_link(request(prototype=str(pid)))
    assert box == pid and tab.selected == "browse"
    card = handlers.deep_link_card(studio, box, request(prototype=str(pid)))
    assert card.card_json["prototype_id"] == pid and card.card_md == handlers.prototype(studio, pid).card_md
    for query in ({}, {"prototype": "five"}):
        box, tab = handlers.deep_link(request(**query))
        assert isinstance(box, type(gr.skip())) and isinstance(tab, type(gr.skip()))
        card = handlers.deep_link_card(studio, 7, request(**query))
        assert all(isinstance(field, type(gr.skip())) for field in card)


def test_interventions_file_round_trip_and_bad_files(studio, state, tmp_path):
    settings, session = state
    path, status = handlers.export_interventions(studio, session)
    path = shown(path)
    assert path and "⚠️" not in status
    data = json.loads(open(path).read())
    assert data["format"] == share.INTERVENTIONS_FORMAT and len(data["items"]) == 4
    fresh, rows, status, mode = handlers.import_interventions(studio, path, Session())
    assert "imported 4" in status and mode == "zero" and rows == session.rows()
    assert fresh.interventions() == session.interventions()
    assert texts(studio, settings, fresh) == texts(studio, settings, session)
    # refused files leave the session as it was
    before = Session().add(suppress_item(1))
    for content, message in [("not json", "not JSON"), (json.dumps({"format": "x"}), "not an interventions file"),
                             (json.dumps({**data, "model": "f" * 16}), "another model"),
                             (json.dumps({**data, "items": [{"kind": "scale", "target": "",
                                                              "prototype_ids": [1, 1], "factor": 2}]}), "repeat")]:
        bad = tmp_path / "bad.json"
        bad.write_text(content)
        after, rows, status, _ = handlers.import_interventions(studio, str(bad), before)
        assert after is before and message in status and rows == before.rows()
    hidden, status = handlers.export_interventions(studio, Session())
    assert "no interventions" in status and shown(hidden) is None


def test_controllers_are_listed_removable_and_kept_out_of_links_unless_shipped(studio, tmp_path):
    path, controller = build_tiny_controller(studio, tmp_path, PROMPT, 6)
    session, *_ = interventions.controller(studio, str(path), None, True, Session().add(suppress_item(2)))
    rows = session.rows()
    assert len(rows) == 2 and rows[1][0] == 1 and rows[1][1].startswith("controller ") and "on" in rows[1][1]
    assert "controller" in session.applied() and "1 suppressed" in session.applied()
    assert session.remove(1).controller is None and session.remove(1).items == session.items
    assert session.clear().controller is None and not session.clear().items
    # a controller from an arbitrary file is not in a link or a file (only shipped ones travel, by name)
    _, status = handlers.share_link(studio, PROMPT, 6, 0, 1, 0, "original", None, session, request())
    assert "not a shipped one" in status
    assert share.decode_link(studio, share.encode_link(studio, GenerationSettings(PROMPT, 6), session)) \
        .session.controller is None
    assert "notes" in share.interventions_json(studio, session)
    assert share.interventions_data(session)["controller"] is None
    # the tiny model has no shipped controller: a name is refused
    data = share.interventions_json(studio, Session())
    with pytest.raises(share.LinkError, match="cannot load"):
        share.import_interventions(studio, {**data, "controller": "next_sentence"}, Session())


@torch.no_grad()
def test_generation_export_holds_every_tokens_exact_decomposition(studio, state):
    settings, session = state
    *_, session, _ = list(handlers.generate(studio, settings.prompt, 6, 0, 1, 0, session))[-1]
    path, status = handlers.export_generation(studio, session)
    path = shown(path)
    data = json.loads(open(path).read())
    assert set(data["runs"]) == {"original", "intervened"} and data["status"] is not None
    for name, gen in (("original", session.original), ("intervened", session.intervened)):
        run = data["runs"][name]
        assert [t["chosen"]["token_id"] for t in run["tokens"]] == gen.token_ids and run["finished"]
        logits = studio.model(gen.input_ids(), interventions=gen.interventions).logits[0]  # independent forward
        for t in run["tokens"]:
            chosen = t["chosen"]
            expected = float(logits[t["position"], chosen["token_id"]])
            assert abs(chosen["residual"] + sum(s["contribution"] for s in chosen["slices"]) - expected) < 1e-3
    _, status = handlers.export_generation(studio, Session())
    assert "generate first" in status


def test_table_and_evidence_csv_hold_what_the_database_holds(studio):
    path = shown(handlers.export_table(studio)[0])
    table = pd.read_csv(path)
    assert list(table["prototype_id"]) == list(range(studio.n_prototypes))
    assert {"label", "category", "label_score", "activation_count"} <= set(table.columns)
    labels = {p: studio.label(p)[0] for p in range(studio.n_prototypes)}
    assert {int(r.prototype_id): ("" if pd.isna(r.label) else r.label) for r in table.itertuples()} == labels
    pid = int(table.sort_values("activation_count", ascending=False)["prototype_id"].iloc[0])
    path = shown(handlers.export_evidence(studio, pid)[0])
    ev = pd.read_csv(path)
    card = studio.need_db().card(pid, n_evidence=export.MAX_EVIDENCE)
    assert len(ev) == len(card.evidence) > 0 and list(ev["rank"]) == [e["rank"] for e in card.evidence]
    assert all(f"[{tok}]" in ctx for tok, ctx in zip(ev["token"], ev["context"]))
    hidden, status = handlers.export_evidence(studio, 999)
    assert shown(hidden) is None and "no prototype 999" in status


def test_a_stopped_generation_keeps_its_tokens_and_is_not_reused(studio):
    settings = GenerationSettings(PROMPT, max_new_tokens=8)
    control, other = handlers.RunControl(), handlers.RunControl()
    stream = handlers.generate(studio, PROMPT, 8, 0, 1, 0, Session(), control)
    for _ in range(3):
        next(stream)
    handlers.request_stop(studio, other)  # another session's Stop does nothing here
    next(stream)
    handlers.request_stop(studio, control)  # the run ends after its current token and writes the last update itself
    rest = list(stream)
    assert len(rest) == 1
    original, _, status, _, session, result = rest[0]
    assert len(session.original.steps) == 4 and not session.original.finished and len(original) == 4
    assert "Stopped after 4 original" in status and len(result["original"]["tokens"]) == 4
    # a token written before Stop can be explained
    _, _, summary, *_ = handlers.decompose(studio, "original", 3, session)
    assert "Token 3" in summary
    # the next run is not stopped by the old request, and the partial text is not reused as the original
    *_, again, _ = list(handlers.generate(studio, PROMPT, 8, 0, 1, 0, session, control))[-1]
    assert again.original is not session.original and again.original.finished and len(again.original.steps) == 8
    assert again.original.token_ids[:4] == session.original.token_ids
    assert again.original.token_ids == studio.generate(settings).token_ids


def test_stop_keeps_at_most_one_token_more_than_the_page_shows(studio):
    # the model ran ahead of the page: 6 tokens written, the page shows 2 when Stop is clicked -> 3 are kept
    control = handlers.RunControl()
    stream = handlers.generate(studio, PROMPT, 12, 0, 1, 0, Session(), control)
    for _ in range(6):
        next(stream)
    handlers.request_stop(studio, control, '{"original": 2, "intervened": 0}')
    *_, session, result = list(stream)[-1]
    assert len(session.original.steps) == 3 and len(result["original"]["tokens"]) == 3
    full = studio.generate(GenerationSettings(PROMPT, max_new_tokens=12))
    assert session.original.token_ids == full.token_ids[:3]  # the first tokens, unchanged
    # a page that sends nothing usable: the run still ends after its current token
    for shown in ("not json", '{"original": "many"}', "[1, 2]"):
        stream = handlers.generate(studio, PROMPT, 12, 0, 1, 0, Session(), control)
        for _ in range(4):
            next(stream)
        handlers.request_stop(studio, control, shown)
        *_, session, _ = list(stream)[-1]
        assert len(session.original.steps) == 4


def test_a_stop_that_arrives_after_the_run_cuts_the_text_to_what_the_page_showed(studio):
    # the page lagged: the run finished all 12 tokens before the Stop sent at 5 shown tokens reached the server
    control = handlers.RunControl()
    handlers.clear_explanation(control)
    *_, session, result = list(handlers.generate(studio, PROMPT, 12, 0, 1, 0, Session(), control))[-1]
    assert len(session.original.steps) == 12 and len(result["original"]["tokens"]) == 12
    original, intervened, status, _, cut, result = handlers.request_stop(studio, control,
                                                                         '{"original": 5, "intervened": 0}', session)
    assert len(cut.original.steps) == 6 and cut.original.token_ids == session.original.token_ids[:6]
    assert len(original) == 6 and len(result["original"]["tokens"]) == 6 and "Stopped after 6 original" in status
    assert cut.intervened is None and intervened == []
    # a second Stop changes nothing
    again = handlers.request_stop(studio, control, '{"original": 2, "intervened": 0}', cut)
    assert all(isinstance(field, dict) and field.get("__type__") == "update" and len(field) == 1
               for field in again)
    # the cut text is not whole: the next Generate with the same settings writes the text again, not reusing it
    handlers.clear_explanation(control)
    *_, regenerated, _ = list(handlers.generate(studio, PROMPT, 12, 0, 1, 0, cut, control))[-1]
    assert not cut.original.finished and regenerated.original is not cut.original
    assert regenerated.original.finished and regenerated.original.token_ids == session.original.token_ids
    # nor does a Stop when the page already shows the whole text
    handlers.clear_explanation(control)
    *_, session, _ = list(handlers.generate(studio, PROMPT, 12, 0, 1, 0, Session(), control))[-1]
    whole = handlers.request_stop(studio, control, '{"original": 12, "intervened": 0}', session)
    assert [f for f in whole if not (isinstance(f, dict) and f.get("__type__") == "update")] == []
    # a run that was stopped while it ran is not cut again
    control = handlers.RunControl()
    stream = handlers.generate(studio, PROMPT, 12, 0, 1, 0, Session(), control)
    for _ in range(4):
        next(stream)
    handlers.request_stop(studio, control, '{"original": 3, "intervened": 0}')
    *_, session, _ = list(stream)[-1]
    assert len(session.original.steps) == 4
    later = handlers.request_stop(studio, control, '{"original": 1, "intervened": 0}', session)
    assert all(isinstance(field, dict) and field.get("__type__") == "update" for field in later)


def test_a_stop_that_arrives_while_the_last_update_is_on_its_way_still_cuts(studio):
    # the run has written all 12 tokens and yielded its last update, which has not reached the page; the page shows
    # 5 when Stop is clicked: Stop's answer cuts to 6, and so does the run's own next update, so whichever lands last
    # the page ends with the cut text (before, this Stop found no finished run and the whole text stayed)
    control = handlers.RunControl()
    handlers.clear_explanation(control)
    stream = handlers.generate(studio, PROMPT, 12, 0, 1, 0, Session(), control)
    updates = []
    while not updates or "Generated" not in updates[-1][2]:
        updates.append(next(stream))
    *_, whole, _ = updates[-1]
    assert len(whole.original.steps) == 12
    answer = handlers.request_stop(studio, control, '{"original": 5, "intervened": 0}', whole)
    original, _, status, _, cut, result = answer
    assert len(cut.original.steps) == 6 and cut.original.token_ids == whole.original.token_ids[:6]
    assert "Stopped after 6 original" in status and len(original) == 6 and len(result["original"]["tokens"]) == 6
    rest = list(stream)
    assert len(rest) == 1
    original, _, status, _, session, result = rest[0]
    assert session.original.token_ids == cut.original.token_ids and not session.original.finished
    assert "Stopped after 6 original" in status and len(original) == 6


def test_stop_reaches_a_run_still_waiting_in_the_queue(studio):
    # Generate's click numbers the run at once (clear_explanation, outside the queue); a Stop pressed before the
    # generation leaves the queue ends it before its first token
    control = handlers.RunControl()
    handlers.clear_explanation(control)
    handlers.request_stop(studio, control, '{"original": 0, "intervened": 0}')
    _, _, status, _, session, _ = list(handlers.generate(studio, PROMPT, 12, 0, 1, 0, Session(), control))[-1]
    assert session.original is None and "Stopped before the first token" in status
    # the next click is a new run that the old Stop does not reach
    handlers.clear_explanation(control)
    *_, session, _ = list(handlers.generate(studio, PROMPT, 12, 0, 1, 0, Session(), control))[-1]
    assert session.original.finished and len(session.original.steps) == 12


def test_bad_share_input_gets_a_message(studio):
    url, status = handlers.share_link(studio, "  ", 8, 0, 1, 0, "original", None, Session(), request())
    assert shown(url) is None and "empty" in status
    with pytest.raises(AppError):
        share.decode_link(studio, "x" * (share.MAX_TOKEN_CHARS + 1))
