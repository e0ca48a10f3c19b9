"""The app's UI-independent logic against the model itself: decompositions sum to the real logit, intervened
continuations equal model.generate with the same Interventions, the prototypes named as the cause of a change
really flip the token, sessions build the right Interventions, and bad input gets a message."""

from __future__ import annotations

import html
from dataclasses import replace

import pytest
import torch
from test_app_support import changing_prototype, shared_assets

from app import handlers, interventions, plots, render, share
from app.core import AppError, GenerationSettings, Studio, side_by_side
from app.limits import Limits
from app.session import MAX_INJECT, Session, group_item, inject_item, scale_item, suppress_item
from prism import Interventions

PROMPT = "the cat sat on the"


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    model, db = shared_assets(tmp_path_factory)
    return Studio.load(model, db)


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    model, _ = shared_assets(tmp_path_factory)
    return Studio.load(model)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-4 * max(1.0, abs(b))


@pytest.mark.parametrize("interventions", [None, "suppress", "reroute", "scale", "inject"])
@torch.no_grad()
def test_decomposition_sums_to_the_real_logit(studio, interventions):
    settings = GenerationSettings(PROMPT, max_new_tokens=6)
    if interventions == "suppress":
        interventions = Interventions(suppress={changing_prototype(studio, settings)})
    elif interventions == "reroute":
        pid = changing_prototype(studio, settings, "reroute")
        interventions = Interventions(suppress={pid}, suppress_mode="reroute")
    elif interventions == "scale":
        interventions = Interventions(scale={0: 2.5, 5: 0.5})
    elif interventions == "inject":
        interventions = Interventions(inject={7: 1.5}, scale={0: 2.5})
    gen = studio.generate(settings, interventions)
    ids = gen.input_ids()  # (1, T)
    logits = studio.model(ids, interventions=interventions).logits[0]  # independent full forward, (T, V)
    for index in range(len(gen.steps)):
        view = studio.token_view(gen, index, n_alternatives=4)
        position = len(gen.prompt_ids) + index - 1
        assert view.chosen.token_id == gen.steps[index].token_id
        assert {a.token_id for a in view.alternatives} >= set(logits[position].topk(3).indices.tolist())
        for d in view.alternatives:
            assert close(d.total, float(logits[position, d.token_id]))
            assert close(d.logit, float(logits[position, d.token_id]))
            assert all(s.activation > 0 for s in d.slices)
            if interventions is not None:
                assert not set(interventions.suppress) & {s.prototype_id for s in d.slices}
        assert close(view.chosen.logit, view.stream_logit)
        # the token view and the streamed step name the same replacements (none unless re-routing)
        assert view.chosen.rerouted_ids == gen.steps[index].rerouted_ids
        if interventions is None or not interventions.reroutes:
            assert view.chosen.rerouted_ids == []
        else:
            own = set(studio.model(ids[:, : position + 1]).prototype_ids[0, position].tolist())
            assert set(view.chosen.removed_ids) == own & interventions.suppress
            assert bool(view.chosen.rerouted_ids) == bool(view.chosen.removed_ids)
            assert set(view.chosen.rerouted_ids) <= {s.prototype_id for s in view.chosen.slices} - own
        # the chart shows the same slices: its relative bars add up to its total bar and to the logit, the
        # residual first and the slices from the largest contribution down
        bars = plots.decomposition_figure(view.chosen).data[0].x
        assert close(sum(bars[:-1]), bars[-1]) and close(bars[-1], float(logits[position, view.chosen.token_id]))
        assert close(bars[0], view.chosen.residual) and list(bars[1:-1]) == sorted(bars[1:-1], reverse=True)
        chart = plots.alternatives_figure(view)
        for row, d in enumerate(view.alternatives):
            stacked = sum(trace.x[row] for trace in chart.data if trace.type == "bar")
            assert close(stacked, d.logit)


@pytest.mark.parametrize("sample", [False, True])
def test_intervened_continuation_equals_model_generate(studio, sample):
    settings = GenerationSettings(PROMPT, max_new_tokens=8, temperature=0.9 if sample else 0.0, top_p=0.9, seed=3)
    interventions = Session().add(suppress_item(changing_prototype(studio, GenerationSettings(PROMPT, 8)))) \
        .add(scale_item(1, 1.7)).interventions()
    gen = studio.generate(settings, interventions)
    ids = torch.tensor([gen.prompt_ids])
    expected = studio.model.generate(ids, 8, interventions=interventions, do_sample=sample, temperature=0.9,
                                     top_p=0.9, seed=3)
    assert gen.token_ids == expected[0, ids.shape[1]:].tolist()
    plain = studio.model.generate(ids, 8, do_sample=sample, temperature=0.9, top_p=0.9, seed=3)
    assert studio.generate(settings).token_ids == plain[0, ids.shape[1]:].tolist()


@torch.no_grad()
def test_why_changed_names_prototypes_that_really_flip_the_token(studio):
    settings = GenerationSettings(PROMPT, max_new_tokens=8)
    pid = changing_prototype(studio, settings)
    # several interventions, only some of which matter at the first change
    interventions = Interventions(suppress={pid, (pid + 1) % studio.n_prototypes}, scale={(pid + 2) % 24: 1.5})
    original = studio.generate(settings)
    intervened = studio.generate(settings, interventions)
    diff = side_by_side(original, intervened)
    assert diff.first_change is not None and diff.status[diff.first_change] == "first change"
    first = diff.first_change
    why = studio.why_changed(original, intervened, first)
    assert why.reference_token == studio.tokenizer.decode([original.steps[first].token_id])
    assert why.flip_set, why.message
    prefix = intervened.input_ids(first)  # the same text before the token in both runs
    ref = original.steps[first].token_id

    def next_token(ids):
        only = Interventions(suppress=interventions.suppress & set(ids),
                             scale={p: f for p, f in interventions.scale.items() if p in ids})
        return int(studio.model.generate(prefix, 1, interventions=only)[0, -1])

    assert next_token(why.flip_set) != ref  # those prototypes alone change the token
    assert next_token(why.flip_set[:-1]) == ref  # and the set is minimal along the ranking
    # the effects add up exactly to the change of the margin logit(new) - logit(ref)
    position = prefix.shape[1] - 1
    new = intervened.steps[first].token_id
    plain = studio.model(prefix).logits[0, position]
    after = studio.model(prefix, interventions=interventions).logits[0, position]
    margin_change = float((after[new] - after[ref]) - (plain[new] - plain[ref]))
    assert close(sum(e["effect"] for e in why.effects), margin_change)
    # tokens before the change are "the same"
    if first > 0:
        assert studio.why_changed(original, intervened, 0).reference_token is None


@torch.no_grad()
def test_why_changed_under_reroute_names_the_replacements(studio):
    settings = GenerationSettings(PROMPT, max_new_tokens=8)
    pid = changing_prototype(studio, settings, "reroute")
    interventions = Interventions(suppress={pid}, suppress_mode="reroute")
    original = studio.generate(settings)
    intervened = studio.generate(settings, interventions)
    first = side_by_side(original, intervened).first_change
    why = studio.why_changed(original, intervened, first)
    prefix = intervened.input_ids(first)
    position = prefix.shape[1] - 1
    own = set(studio.model(prefix).prototype_ids[0, position].tolist())
    used = studio.model(prefix, interventions=interventions)
    used_ids = set(used.used_prototype_ids[0, position][used.used_activations[0, position] > 0].tolist())
    assert why.replacements and {r["prototype_id"] for r in why.replacements} == used_ids - own
    assert all(r["role"] == "replacement" and r["activation"] > 0 for r in why.replacements)
    assert "re-routed to" in why.message and f"#{why.replacements[0]['prototype_id']}" in why.message
    assert pid in {e["prototype_id"] for e in why.effects if e["role"] == "intervened"}
    # the effects of the suppressed prototype and its replacements add up exactly to the margin's change
    new, ref = intervened.steps[first].token_id, original.steps[first].token_id
    plain, after = studio.model(prefix).logits[0, position], used.logits[0, position]
    margin_change = float((after[new] - after[ref]) - (plain[new] - plain[ref]))
    assert close(sum(e["effect"] for e in why.effects), margin_change)
    # the page's table: one row per prototype (at most `rows`, the rest summed), roles, and the exact total
    table = [line for line in render.why_table(why, rows=1).splitlines() if line.startswith("| ")]
    body = table[1:]
    assert len(body) == 1 + (len(why.effects) > 1) + 1
    assert body[0].startswith(f"| #{why.effects[0]['prototype_id']} ")
    assert float(body[-1].split("|")[-2].strip(" *")) == pytest.approx(margin_change, abs=1.5e-3)
    if len(why.effects) > 1:
        assert float(body[1].split("|")[-2]) == pytest.approx(sum(e["effect"] for e in why.effects[1:]), abs=1.5e-3)
    whole = render.why_table(why)
    assert whole.count("took a suppressed slot") == sum(e["role"] == "replacement" for e in why.effects[:8])
    # the flip set holds only intervened prototypes, and re-routing it alone changes the token
    assert why.flip_set == [pid]
    assert int(studio.model.generate(prefix, 1, interventions=interventions)[0, -1]) != ref


def test_generation_stops_at_a_special_token_and_never_shows_it(studio):
    assert studio.stop_ids == set(studio.tokenizer.all_special_ids) and studio.stop_ids
    settings = GenerationSettings(PROMPT, max_new_tokens=6)
    full = studio.generate(settings)
    stop = full.steps[2].token_id  # pretend the third token the model writes is the end of text
    saved = studio.stop_ids
    try:
        studio.stop_ids = frozenset({stop})
        cut = studio.generate(settings)
    finally:
        studio.stop_ids = saved
    first = full.token_ids.index(stop)
    assert cut.token_ids == full.token_ids[:first] and "ended the text" in cut.notes[-1]
    assert stop not in cut.token_ids


def test_every_token_is_one_chip_and_newlines_show_as_a_mark_then_a_break(studio):
    gen = studio.generate(GenerationSettings(PROMPT, max_new_tokens=4))
    steps = list(gen.steps)  # generations are values: make one whose tokens read as line breaks would
    steps[1], steps[2] = replace(steps[1], text="\n\n"), replace(steps[2], text=" end\r\n")
    gen = replace(gen, steps=tuple(steps))
    chips = handlers._highlights(studio, gen)
    assert len(chips) == len(gen.steps)
    assert [c[0] for c in chips][1:3] == [handlers.NEWLINE * 2, " end" + handlers.NEWLINE]
    # every line break stays (the page breaks the line there) behind a mark that can be clicked
    assert not any("\r" in text for text, _ in chips)
    assert all(text.count("\n") == text.count("⏎\n") for text, _ in chips) and "".join(
        text for text, _ in chips).count("\n") == 3


def test_token_summary_says_whether_the_chosen_token_had_the_highest_logit(studio):
    greedy = studio.generate(GenerationSettings(PROMPT, max_new_tokens=6))
    summary = render.token_summary(studio.token_view(greedy, 0), None)
    assert "Chosen: the highest logit; next best" in summary and "Runner-up" not in summary
    sampled = studio.generate(GenerationSettings(PROMPT, max_new_tokens=24, temperature=2.0, seed=1))
    for index in range(len(sampled.steps)):
        view = studio.token_view(sampled, index)
        if view.alternatives[0].token_id != view.chosen.token_id:  # alternatives are sorted by logit
            summary = render.token_summary(view, None)
            assert "Chosen (sampled)" in summary and html.escape(repr(view.alternatives[0].token)) in summary
            break
    else:
        pytest.fail("at temperature 2 some sampled token should not be the argmax")


@torch.no_grad()
def test_the_view_says_what_the_prototypes_carry_of_the_choice_over_the_runner_up(studio):
    """The carried share against prism.explain's path measure on an independent full forward (the same position's
    margin share when the chosen token is the top one), and in the summary, the figure and the data."""
    seen = {"top": 0, "sampled": 0}
    for gen in (studio.generate(GenerationSettings(PROMPT, max_new_tokens=8)),
                studio.generate(GenerationSettings(PROMPT, max_new_tokens=8, temperature=1.5, seed=3))):
        _check_carried(studio, gen, seen)
    assert seen["top"] and seen["sampled"], seen


def _check_carried(studio, gen, seen):
    from prism.explain import path_statistics

    model = studio.model
    out = model(gen.input_ids())
    shares = path_statistics(out.z, out.z_hat, model.lm_head.weight, model.lm_head.bias).share
    for index in range(len(gen.steps)):
        view = studio.token_view(gen, index)
        c = view.carried
        runner = next(a for a in view.alternatives if a.token_id != view.chosen.token_id)
        assert c.runner_up_id == runner.token_id and c.gap == pytest.approx(view.chosen.logit - runner.logit)
        slices = sum(x.contribution for x in view.chosen.slices) - sum(x.contribution for x in runner.slices)
        assert c.prototypes == pytest.approx(slices / c.gap, rel=1e-4, abs=1e-5)
        assert c.residual == pytest.approx((view.chosen.residual - runner.residual) / c.gap, rel=1e-3, abs=1e-4)
        if view.alternatives[0].token_id == view.chosen.token_id:  # the top token: the path measure's own share
            seen["top"] += 1
            assert c.prototypes == pytest.approx(float(shares[view.position]), rel=1e-3, abs=1e-4)
        else:
            seen["sampled"] += 1
            assert c.gap < 0
        summary = render.token_summary(view, None)
        assert f"the prototypes **{100 * c.prototypes:.0f}%**, the residual **{100 * c.residual:.0f}%**" in summary
        # the warning is for the model's own choice; a sampled token below the runner-up gets the gap split instead
        assert ("The residual decides this choice" in summary) == (c.prototypes < 0.5 and c.gap > 0)
        assert ("Sampled below" in summary) == (c.gap < 0)
        assert ("pull opposite ways" in summary) == (not 0 <= c.prototypes <= 1)
        title = plots.decomposition_figure(view.chosen, c).layout.title.text
        assert f"prototypes carry {100 * c.prototypes:.0f}%" in title
        assert ("the residual decides" in title) == (c.prototypes < 0.5 and c.gap > 0)
        assert view.as_dict()["carried"] == {**c.as_dict(), "residual_decides": c.prototypes < 0.5}


def test_a_new_generation_clears_the_explanation_panel(studio):
    waterfall, alternatives, summary, rows, data, attribution, attribution_data, status = handlers.clear_explanation()
    assert "new text" in summary and status == "Generating…"
    assert rows == [] and data is None and attribution_data is None
    assert handlers.refresh_attribution(studio, None, "original", 3, Session()) == (handlers.EMPTY_ATTRIBUTION, None)


def test_session_suppress_mode_defaults_to_reroute_and_is_per_session():
    s = Session().add(suppress_item(3)).add(scale_item(4, 2.0))
    assert s.suppress_mode == "reroute" and s.interventions().suppress_mode == "reroute"
    zero = s.with_suppress_mode("zero")
    assert zero.interventions().suppress_mode == "zero" and s.interventions().suppress_mode == "reroute"
    assert zero.with_suppress_mode("re-route to the nearest prototypes").suppress_mode == "reroute"
    with pytest.raises(ValueError, match="suppress mode must be one of"):
        s.with_suppress_mode("erase")
    same, rows, status = interventions.suppress_mode("erase", s)
    assert same is s and status.startswith("⚠️") and len(rows) == 2
    changed, _, status = interventions.suppress_mode("zero", s)
    assert changed.suppress_mode == "zero" and "remove the slice" in status and changed.items == s.items


def test_session_builds_interventions():
    s = Session().add(suppress_item(3)).add(scale_item(4, 2.0)).add(group_item("category", "numbers/time", [4, 5]))
    s = s.add(scale_item(6, 1.0)).add(scale_item(7, 0.5)).add(scale_item(7, 3.0))
    iv = s.interventions()
    assert iv.suppress == {3, 4, 5} and iv.scale == {7: 3.0}  # suppression wins, the later scale counts, x1 no-op
    assert s.remove(2).interventions().scale == {4: 2.0, 7: 3.0}
    assert s.clear().interventions().is_empty
    assert Session().add(scale_item(2, 0.0)).interventions().suppress == {2}
    with pytest.raises(ValueError):
        s.remove(99)
    with pytest.raises(ValueError):
        scale_item(1, 11.0)
    with pytest.raises(ValueError):
        group_item("search", "nothing", [])
    assert [r[0] for r in s.rows()] == list(range(6))


def test_group_interventions_from_the_database(studio):
    category = studio.db.categories[0]
    ids = studio.need_db().category_ids(category)
    assert ids and all(studio.label(p)[1] == category for p in ids)
    session, rows, status = interventions.suppress_category(studio, category, Session())
    assert session.interventions().suppress == set(ids) and "category" in rows[0][1]
    label = studio.label(ids[0])[0]
    session, _, status = interventions.suppress_search(studio, label, "label", session)
    assert ids[0] in session.items[-1].prototype_ids and "⚠️" not in status
    session, _, status = interventions.suppress_search(studio, "numbers", "semantic", session)
    assert len(session.items) == 3 and len(session.items[-1].prototype_ids) <= 10
    _, _, status = interventions.suppress(studio, 999, session)
    assert "no prototype 999" in status
    _, _, status = interventions.suppress_category(studio, "not a category", session)
    assert status.startswith("⚠️")


def test_bad_input_gets_a_message(studio):
    with pytest.raises(AppError, match="empty"):
        studio.generate(GenerationSettings("   "))
    long = " ".join(["the cat sat"] * 200)  # far beyond the tiny model's 256-token context
    with pytest.raises(AppError, match="at most 512"):  # the app's own limit comes first
        studio.generate(GenerationSettings(long, max_new_tokens=10))
    default = studio.limits
    try:
        studio.limits = Limits(max_prompt_tokens=10_000)  # an app that allows it: the model's context truncates
        gen = studio.generate(GenerationSettings(long, max_new_tokens=10))
    finally:
        studio.limits = default
    assert len(gen.prompt_ids) + 10 <= studio.model.max_length and "context" in gen.notes[0]
    assert len(gen.steps) == 10
    with pytest.raises(AppError):
        studio.token_view(gen, 10)
    with pytest.raises(AppError):
        studio.need_db().card(999)
    with pytest.raises(AppError):
        studio.need_db().card("x; DROP TABLE labels")
    for text in ["'; DROP TABLE labels; --", "%", "_", "\x00\x01", "<script>alert(1)</script>", "a" * 10_000]:
        rows, status = handlers.search(studio, text, "label", "all", "label score")
        assert isinstance(rows, list)
        assert ("type something" in status) if text == "\x00\x01" else "⚠️" not in status
        rows, status = handlers.search(studio, text, "semantic", "all", "activation count")
        assert isinstance(rows, list)
    assert len(studio.need_db().table()) == studio.n_prototypes  # nothing was dropped
    md, *_ = handlers.prototype(studio, "<b>1</b>")
    assert md.startswith("⚠️")


def test_generate_and_decompose_handlers(studio):
    session = Session().add(suppress_item(changing_prototype(studio, GenerationSettings(PROMPT, 6))))
    outputs, seen = [], []
    for out in handlers.generate(studio, PROMPT, 6, 0, 1, 0, session):
        outputs.append(out)
        # while streaming, the session already holds the growing texts (a token can be explained before the end)
        seen.append((len(out[0]), len(out[4].original.steps) if out[4].original else 0))
    assert len(outputs) >= 6  # streamed: one update per step at least
    assert all(chips == held for chips, held in seen) and [c for c, _ in seen][:3] == [1, 2, 3]
    original, intervened, status, title, session, result = outputs[-1]
    assert len(original) == 6 and any(label == handlers.CHANGED for _, label in intervened)
    assert "1 suppressed (re-routed)" in title  # the column says what was applied
    assert result["first_change"] is not None and "changed" in status
    fig, alt, summary, rows, top, session, data = handlers.decompose(studio, "intervened", result["first_change"],
                                                                     session)
    assert data["why_changed"]["flip_set"] and close(data["chosen"]["sum"], data["chosen"]["logit"])
    assert top == rows[0][0] and session.selected == ("intervened", result["first_change"])
    md, signature, histogram, evidence, card = handlers.prototype(studio, top)
    assert card["prototype_id"] == top and "outline" in evidence  # the evidence token is highlighted
    # the stored original is reused when only the interventions change
    again = list(handlers.generate(studio, PROMPT, 6, 0, 1, 0, session.clear()))
    assert again[-1][4].original is session.original and again[-1][4].intervened is None
    assert again[-1][3] == handlers.INTERVENED_TITLE


def test_without_a_database(bare, tmp_path, tmp_path_factory):
    model_path, _ = shared_assets(tmp_path_factory)
    gen = bare.generate(GenerationSettings(PROMPT, max_new_tokens=4))
    view = bare.token_view(gen, 1)
    assert close(view.chosen.total, view.chosen.logit) and all(s.category == "unlabelled" for s in view.chosen.slices)
    with pytest.raises(AppError, match="precompute build"):
        bare.need_db().card(0)
    rows, status = handlers.search(bare, "year", "label", "all", "label score")
    assert rows == [] and "precompute build" in status
    corrupt = tmp_path / "corrupt.duckdb"
    corrupt.write_bytes(b"this is not a database" * 100)
    loaded = Studio.load(model_path, corrupt)
    assert loaded.db is None and "could not be opened" in loaded.db_error
    with pytest.raises(AppError, match="could not be opened"):
        loaded.need_db().card(0)
    missing = Studio.load(model_path, tmp_path / "missing.duckdb")
    assert missing.db is None and "no database" in missing.db_error


def test_a_token_click_crosses_into_the_library_once_and_changes_no_value(studio, monkeypatch):
    """handlers.decompose on a token of the intervened text: one call of prism.explain.explain_token (the
    decomposition, alternatives, carried share and what changed, all from it), and the session's generations are
    the same values after the click (generations are immutable: nothing is written into them)."""
    import app.core as core

    settings = GenerationSettings(PROMPT, max_new_tokens=6)
    pid = changing_prototype(studio, settings)
    session = interventions.suppress(studio, pid, Session()).session
    *_, session, result = list(handlers.generate(studio, PROMPT, 6, 0, 1, 0, session))[-1]
    calls = []
    real = core.explain_token

    def counted(*args, **kwargs):
        calls.append(kwargs.get("against"))
        return real(*args, **kwargs)

    monkeypatch.setattr(core, "explain_token", counted)
    before = (session.original.steps, session.intervened.steps, session.intervened.notes)
    token = handlers.decompose(studio, "intervened", result["first_change"], session)
    assert len(calls) == 1 and calls[0] is not None  # one crossing, the comparison with the original included
    assert token.token_json["why_changed"]["flip_set"] and token.proto_id == token.active[0][0]
    assert (session.original.steps, session.intervened.steps, session.intervened.notes) == before
    with pytest.raises(AttributeError):
        session.intervened.steps[0].text = "x"  # a frozen value


def test_who_pushes_a_token_lists_the_prototypes_whose_signature_raises_it_most(studio):
    token_id = studio.tokenizer(" the", add_special_tokens=False)["input_ids"][0]
    rows, status = handlers.search(studio, " the", handlers.PUSHES, "all", "relevance")
    values = studio.model.prototypes.weight @ studio.model.lm_head.weight[token_id]  # (K,) (W p_i)[token]
    expected = values.argsort(descending=True)[: len(rows)].tolist()
    assert [r[0] for r in rows] == expected and "raises ' the' most" in status
    assert [r[-1] for r in rows] == pytest.approx([round(float(values[p]), 3) for p in expected], abs=1e-3)
    two = handlers.search(studio, " the cat", handlers.PUSHES, "all", "relevance")[1]
    n = len(studio.tokenizer(" the cat", add_special_tokens=False)["input_ids"])
    assert f"is {n} tokens; using the first" in two
    assert handlers.search(studio, "   ", handlers.PUSHES, "all", "relevance")[1].endswith("sorted by relevance")


def test_the_summary_and_the_data_give_probabilities_beside_logits(studio):
    gen = studio.generate(GenerationSettings(PROMPT, max_new_tokens=3))
    view = studio.token_view(gen, 1)
    logits = studio.model(gen.input_ids()).logits[0, view.position].double()
    probs = logits.softmax(-1)
    for a in view.alternatives:
        assert a.probability == pytest.approx(float(probs[a.token_id]), abs=1e-5)
    assert f"probability {render.probability(view.chosen.probability)}" in render.token_summary(view, None)
    # readable at both ends: three decimals, and a tiny probability in two significant digits, never '0.000'
    assert render.probability(0.4213) == "0.421" and render.probability(0.0000347) == "3.5e-05"
    assert float(render.probability(0.0004)) == pytest.approx(0.0004) and render.probability(0.0) == "0.000"
    assert view.as_dict()["chosen"]["probability"] == view.chosen.probability


def test_contrast_of_the_explained_token_with_any_other_splits_their_logit_gap_exactly(studio):
    settings = GenerationSettings(PROMPT, max_new_tokens=4)
    session = interventions.scale(studio, 3, 2.0, Session()).session
    *_, session, _ = list(handlers.generate(studio, PROMPT, 4, 0, 1, 0, session))[-1]
    other_id = studio.tokenizer(" cat", add_special_tokens=False)["input_ids"][0]
    for run, gen in (("original", session.original), ("intervened", session.intervened)):
        figure, summary, data = handlers.contrast(studio, run, 2, " cat", session)
        logits = studio.model(gen.input_ids(), interventions=gen.interventions).logits[0, len(gen.prompt_ids) + 1]
        chosen = gen.steps[2].token_id
        assert data["token_a"] == chosen and data["token_b"] == other_id
        assert data["margin"] == pytest.approx(float(logits[chosen] - logits[other_id]), abs=1e-3)
        assert data["residual"] + sum(p["contribution"] for p in data["parts"]) == pytest.approx(data["margin"],
                                                                                                abs=1e-4)
        assert "Why" in summary and "logit gap" in summary
        assert sum(figure.data[0].x) == pytest.approx(data["margin"], abs=1e-3)  # the bars add up to the gap
    for bad in ("", None, "x" * 300):
        _, status, data = handlers.contrast(studio, "original", 2, bad, session)
        assert status.startswith("⚠️") and data is None
    assert handlers.contrast(studio, "original", 99, " cat", session)[1].startswith("⚠️")
    assert settings.max_new_tokens == 4


@torch.no_grad()
def test_injection_moves_every_logit_by_exactly_the_injected_slice(studio):
    """The Inject button's handler, then a generation: at every position of the intervened text its logits minus
    the same text's logits without interventions are (a - a_own) W p, with a_own the prototype's own activation
    there (0 where the model does not select it); the token view lists the injected slice."""
    pid, a = 5, 4.0
    panel = interventions.inject(studio, pid, a, Session())
    assert panel.iv_status.startswith("added: inject") and panel.session.interventions().inject == {pid: a}
    *_, session, _ = list(handlers.generate(studio, PROMPT, 6, 0, 1, 0, panel.session))[-1]
    gen = session.intervened
    ids = gen.input_ids()
    plain = studio.model(ids)
    steered = studio.model(ids, interventions=gen.interventions).logits[0]
    w_p = studio.model.lm_head.weight.float() @ studio.model.prototypes.weight[pid].float()  # (V,)
    own = (plain.activations[0] * (plain.prototype_ids[0] == pid)).sum(-1)  # (T,)
    expected = plain.logits[0] + (a - own)[:, None] * w_p[None, :]
    torch.testing.assert_close(steered, expected, rtol=1e-4, atol=1e-4)
    assert bool((own == 0).any())  # somewhere it was not active: the injection is what puts it there
    for index in range(len(gen.steps)):
        view = studio.token_view(gen, index)
        mine = [s for s in view.chosen.slices if s.prototype_id == pid]
        assert len(mine) == 1 and mine[0].activation == pytest.approx(a)
        assert mine[0].contribution == pytest.approx(a * float(w_p[gen.steps[index].token_id]), rel=1e-4, abs=1e-4)


def test_injection_items_and_their_limits(studio):
    s = Session().add(scale_item(3, 2.0)).add(inject_item(3, 1.5)).add(inject_item(4, 2.0)).add(suppress_item(4))
    iv = s.interventions()
    assert iv.inject == {3: 1.5} and iv.scale == {} and iv.suppress == {4}  # the later of scale/inject; suppress wins
    assert s.add(scale_item(3, 0.5)).interventions().scale == {3: 0.5} and not s.add(scale_item(3, 0.5)) \
        .interventions().inject
    assert "1 injected" in Session().add(inject_item(2, 1.0)).applied()
    for bad in (0, -1, MAX_INJECT + 1, float("nan"), "x", None):
        panel = interventions.inject(studio, 2, bad, Session())
        assert panel.iv_status.startswith("⚠️") and panel.session.items == ()
    assert interventions.inject(studio, 10_000, 1.0, Session()).iv_status.startswith("⚠️")


def test_scaling_a_prototype_the_text_never_uses_says_so_and_offers_injection(studio):
    gen = studio.generate(GenerationSettings(PROMPT, max_new_tokens=6))
    used = {p for step in gen.steps for p in step.prototype_ids}
    idle = next(p for p in range(studio.n_prototypes) if p not in used)
    session = interventions.scale(studio, idle, 3.0, Session()).session
    panel = list(handlers.generate(studio, PROMPT, 6, 0, 1, 0, session))[-1]
    # scaling rescales what the model selects and never selects anything new, so the text stays the same
    assert not any(idle in step.prototype_ids for step in panel.session.intervened.steps)
    assert "never active in this text" in panel.gen_status and f"#{idle}" in panel.gen_status
    assert "inject it" in panel.gen_status
    busy = next(iter(used))
    panel = list(handlers.generate(studio, PROMPT, 6, 0, 1, 0,
                                   interventions.scale(studio, busy, 1.5, Session()).session))[-1]
    assert "never active" not in panel.gen_status


@torch.no_grad()
def test_a_prompt_token_is_explained_like_a_generated_one(studio):
    """A prompt token's explanation is the split of the logit the model gave it after the prompt before it: from an
    independent forward pass over the prompt alone, every alternative's slices add up to its logit; contrast and
    the link name the same token; the first prompt token and indices past the prompt get a clear message."""
    session = interventions.scale(studio, 3, 2.0, Session()).session  # the prompt is read without interventions
    *_, session, _ = list(handlers.generate(studio, PROMPT, 3, 0, 1, 0, session))[-1]
    ids = studio.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert list(session.original.prompt_ids) == ids and len(ids) >= 3
    logits = studio.model(torch.tensor([ids])).logits[0]  # (T, V), the plain model over the prompt only
    for index in range(1, len(ids)):
        panel = handlers.decompose(studio, handlers.PROMPT, index, session)
        data = panel.token_json
        assert data["in_prompt"] and data["index"] == index and data["position"] == index - 1
        assert data["chosen"]["token_id"] == ids[index] and data["stream_logit"] is None
        for d in data["alternatives"]:
            assert close(d["sum"], float(logits[index - 1, d["token_id"]]))
            assert close(d["logit"], float(logits[index - 1, d["token_id"]]))
        assert f"Prompt token {index}" in panel.token_md and "while generating" not in panel.token_md
        assert panel.session.selected == (handlers.PROMPT, index)
        # the top alternative's probability is the softmax of the independent logits
        top = data["alternatives"][0]
        assert top["probability"] == pytest.approx(float(logits[index - 1].softmax(-1)[top["token_id"]]), abs=1e-5)
    _, _, data = handlers.contrast(studio, handlers.PROMPT, 2, " cat", session)
    other = studio.tokenizer(" cat", add_special_tokens=False)["input_ids"][0]
    assert data["token_a"] == ids[2] and data["margin"] == pytest.approx(float(logits[1, ids[2]] - logits[1, other]),
                                                                         abs=1e-3)
    # the strip of prompt tokens: one clickable chip per prompt token, the first marked
    strip = handlers.prompt_tokens(studio, session)
    assert [t for t, _ in strip] == [studio.decode(i) for i in ids]
    assert [c for _, c in strip] == [handlers.PROMPT_FIRST] + [handlers.PROMPT_TOKEN] * (len(ids) - 1)
    assert handlers.prompt_tokens(studio, Session()) == []
    # bad indices: a message naming the valid range, and the session unchanged
    for bad, words in ((0, "prompt token 0 is the first"), (len(ids), "there is no prompt token"),
                       (-1, "there is no prompt token"), (1.5, "whole number")):
        panel = handlers.decompose(studio, handlers.PROMPT, bad, session)
        assert panel.token_md.startswith("⚠️") and words in panel.token_md and panel.session is session
        assert f"1 to {len(ids) - 1}" in panel.token_md or words == "whole number"
    assert handlers.decompose(studio, handlers.PROMPT, 1, Session()).token_md.startswith("⚠️ generate first")
    # a link to an explained prompt token restores it; a link to prompt token 0 or past the prompt is refused
    token = handlers.decompose(studio, handlers.PROMPT, 2, session).token_json
    url, status = handlers.share_link(studio, PROMPT, 3, 0, 1, 0, handlers.PROMPT, token, session)
    link = share.decode_link(studio, url.split(f"{share.PARAM}=")[1])
    assert link.selected == (handlers.PROMPT, 2) and "explained token" in status
    for bad in (0, len(ids)):
        made = share.encode_link(studio, GenerationSettings(PROMPT, 3), session, (handlers.PROMPT, bad))
        with pytest.raises(AppError, match="prompt tokens-1"):
            share.decode_link(studio, made)
    assert handlers.share_link(studio, PROMPT, 3, 0, 1, 0, handlers.PROMPT, {"index": 0}, session)[0] == ""
