"""Intervention presets: each rule picks exactly the prototypes an independent computation picks; the job is
idempotent and refuses other arguments; the behaviour-removal benchmark runs end to end on a tiny model."""

from __future__ import annotations

import json
import math
import random
import re

import pytest
import torch
from test_app_support import build_tiny_db, build_tiny_model

from precompute import presets
from precompute.runs import JobArgsMismatch, connect, start_job
from prism.backbones import load_backbone, load_tokenizer

MARKERS = set(presets.PRESETS["kjv-register"].markers)
OTHER = ["the", " of", " and", " you", " him", "ing", " said", " lord", " art", "thee-like"]


def _fill(path, seed=0, n=40):
    """A database with made-up labels, next tokens and logit signatures for n prototypes; returns the rows."""
    rng = random.Random(seed)
    con = connect(path)
    start_job(con, "evidence", {"synthetic": True})
    start_job(con, "labels", {"synthetic": True})
    rows = {"labels": [], "next": [], "sig": []}
    for pid in range(n):
        kind = rng.random()
        marker = rng.choice(sorted(MARKERS))
        if kind < 0.2:  # the label names a marker token
            label = f"'{marker}' after ','"
        elif kind < 0.4:  # a marker among the context words only: not a marker label
            label = f"'the' near {marker}, grace → 'of'"
        elif kind < 0.5:  # the label names the markers' kind
            label = "archaic verb forms after ','"
        else:
            label = f"'{rng.choice(['verbs', 'thereof', 'end', 'Thee'])}' after ',' → 'and'"
        rows["labels"].append((pid, "misc", label, 0.7, "synthetic", None))
        for rank in range(5):
            token = rng.choice([" " + rng.choice(sorted(MARKERS)).capitalize(), *OTHER])
            rows["next"].append((pid, rank, rank, token, rng.randint(1, 9)))
        for rank in range(15):
            token = rng.choice([" " + rng.choice(sorted(MARKERS)), *OTHER, *OTHER])
            rows["sig"].append((pid, rank, rank, token, float(15 - rank)))
    con.executemany("INSERT INTO labels (prototype_id, category, label, label_score, labeler, explanation) "
                    "VALUES (?, ?, ?, ?, ?, ?)", rows["labels"])
    con.executemany("INSERT INTO next_tokens VALUES (?, ?, ?, ?, ?)", rows["next"])
    con.executemany("INSERT INTO logit_signatures VALUES (?, ?, ?, ?, ?)", rows["sig"])
    con.close()
    return rows


def _expected(rows, args: presets.PresetArgs) -> dict[int, list[str]]:
    """The three rules written plainly in Python over the same rows."""
    min_share, signature_top = args.for_preset(presets.PRESETS["kjv-register"])
    found: dict[int, list[str]] = {}
    for pid, _, label, *_ in rows["labels"]:  # a quoted (named) token is a marker, or the label names their kind
        if any(q.strip().lower() in MARKERS for q in re.findall(r"'([^']*)'", label)) or \
                label.startswith("archaic verb forms"):
            found.setdefault(pid, []).append("label")
    totals, hits = {}, {}
    for pid, _, _, token, count in rows["next"]:
        totals[pid] = totals.get(pid, 0) + count
        hits[pid] = hits.get(pid, 0) + (count if token.strip().lower() in MARKERS else 0)
    for pid in sorted(totals):
        if hits[pid] >= min_share * totals[pid]:
            found.setdefault(pid, []).append("next_token")
    for pid in sorted({r[0] for r in rows["sig"]}):
        if any(token.strip().lower() in MARKERS for p, rank, _, token, _ in rows["sig"]
               if p == pid and rank < signature_top):
            found.setdefault(pid, []).append("signature")
    return {pid: found[pid] for pid in sorted(found)}


@pytest.mark.parametrize("min_share,signature_top", [(0.3, 10), (0.5, 3)])
def test_rules_match_an_independent_computation(tmp_path, min_share, signature_top):
    rows = _fill(tmp_path / "db.duckdb")
    args = presets.PresetArgs(min_share=min_share, signature_top=signature_top)
    con = connect(tmp_path / "db.duckdb")
    counts = presets.run(con, args)
    stored = {r["prototype_id"]: r["reasons"] for r in presets.preset_prototypes(con, "kjv-register")}
    con.close()
    expected = _expected(rows, args)
    assert stored == expected and counts == {"kjv-register": len(expected), "numbers": 0}
    assert {"label", "next_token", "signature"} <= {r for reasons in expected.values() for r in reasons}
    assert 0 < len(expected) < 40  # the rules select, they do not take everything


def test_job_is_idempotent_and_refuses_other_arguments(tmp_path):
    _fill(tmp_path / "db.duckdb")
    con = connect(tmp_path / "db.duckdb")
    first = presets.run(con, presets.PresetArgs())
    rows = con.execute("SELECT * FROM presets ORDER BY ALL").fetchall()
    assert presets.run(con, presets.PresetArgs()) == first
    assert con.execute("SELECT * FROM presets ORDER BY ALL").fetchall() == rows
    with pytest.raises(JobArgsMismatch, match="min_share"):
        presets.run(con, presets.PresetArgs(min_share=0.9))
    assert con.execute("SELECT * FROM presets ORDER BY ALL").fetchall() == rows  # refused: nothing changed
    fewer = presets.run(con, presets.PresetArgs(rules=("label",)), overwrite=True)
    assert fewer["kjv-register"] < first["kjv-register"]
    con.close()


def test_bad_arguments_and_missing_jobs_get_clear_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="min-share"):
        presets.PresetArgs(min_share=0)
    with pytest.raises(ValueError, match="rules"):
        presets.PresetArgs(rules=("vibes",))
    with pytest.raises(ValueError, match="unknown presets"):
        presets.PresetArgs(presets=("nsfw",))
    con = connect(tmp_path / "empty.duckdb")
    with pytest.raises(RuntimeError, match="labels job"):
        presets.run(con, presets.PresetArgs())
    con.close()
    with pytest.raises(SystemExit):
        presets.main(["--db", str(tmp_path / "missing.duckdb")])
    assert "no database" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        presets.main(["--help"])
    assert "--min-share" in capsys.readouterr().out


def test_cli_runs_and_shows(tmp_path, capsys):
    rows = _fill(tmp_path / "db.duckdb")
    counts = presets.main(["--db", str(tmp_path / "db.duckdb")])
    assert counts["kjv-register"] == len(_expected(rows, presets.PresetArgs())) and set(counts) == set(presets.PRESETS)
    shown = presets.main(["--db", str(tmp_path / "db.duckdb"), "--show", "kjv-register"])
    out = capsys.readouterr().out
    assert len(shown) == counts["kjv-register"] and str(shown[0]["prototype_id"]) in out


def test_numbers_preset_counts_digits_and_number_words(tmp_path):
    spec = presets.PRESETS["numbers"]
    assert spec.marker_pattern().findall("In 1987, two hundred and 34 people; someone won 3rd place") == \
        ["1987", "two", "hundred", "34"]
    con = connect(tmp_path / "db.duckdb")
    start_job(con, "evidence", {"synthetic": True})
    signature = {0: [" 1", " the", " and"], 1: [" the", " and", " Two"], 2: [" the", " of", " a"],
                 3: ["3rd", " the", " of"], 4: [" the", " and", " of", " a", " in", " 19"]}
    con.executemany("INSERT INTO logit_signatures VALUES (?, ?, ?, ?, ?)",
                    [(pid, rank, rank, token, 1.0) for pid, tokens in signature.items()
                     for rank, token in enumerate(tokens)])
    con.executemany("INSERT INTO next_tokens VALUES (?, ?, ?, ?, ?)",
                    [(0, 0, 0, " the", 5), (2, 0, 0, "4", 3), (2, 1, 1, " of", 2), (3, 0, 0, " eleven", 1),
                     (3, 1, 1, " the", 9)])
    found = presets.find_prototypes(con, spec, presets.PresetArgs(rules=("next_token", "signature"),
                                                                  signature_top=3))
    # signature: '1' and 'Two' in the top 3 (not '3rd', not the 6th-ranked '19'); next_token: 3/5 digits >= 0.3
    assert found == {0: ["signature"], 1: ["signature"], 2: ["next_token"]}
    deeper = presets.find_prototypes(con, spec, presets.PresetArgs(rules=("signature",), signature_top=6))
    assert sorted(deeper) == [0, 1, 4]


def test_marker_pattern_counts_whole_words_only():
    pattern = presets.PRESETS["kjv-register"].marker_pattern()
    assert pattern.findall("Thou art there; unto THEE, ye theatre thereof yet") == ["Thou", "unto", "THEE", "ye"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny saved model and its full database, with the preset stored by hand (the tiny tokenizer knows no
    King James words, so the real rules find nothing): prototypes 0-2."""
    root = tmp_path_factory.mktemp("presets")
    model = build_tiny_model(root)
    db = build_tiny_db(root, model)
    con = connect(db)
    con.execute("DELETE FROM presets")
    con.executemany("INSERT INTO presets VALUES ('kjv-register', ?, ['signature'])", [[0], [1], [2]])
    n = con.execute("SELECT count(*) FROM prototype_stats").fetchone()[0]
    con.close()
    return {"model": model, "db": db, "n": n}


def test_behaviour_removal_bench_runs_on_a_tiny_model(tiny, tmp_path, capsys):
    from bench import behaviour_removal

    result = behaviour_removal.main(["--model", str(tiny["model"]), "--db", str(tiny["db"]), "--prompts", "4",
                                     "--max-new-tokens", "3", "--max-eval-tokens", "64", "--seq-len", "16",
                                     "--batch-size", "2", "--out", str(tmp_path / "b.json"),
                                     "--judge", str(tiny["model"].parent / "backbone")])
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line == json.loads((tmp_path / "b.json").read_text())
    assert result["n_prototypes"] == 3 and result["share_of_bank"] == 3 / tiny["n"] and result["prompts"] == 4
    assert result["modes"] == ["zero", "reroute"]
    before, zero, reroute = result["before"], result["zero"], result["reroute"]
    assert before["rate"]["words"] > 0 and len(result["examples"]) == 4
    assert set(result["examples"][0]) == {"prompt", "before", "zero", "reroute"}
    assert before["ppl_other"] > 1 and result["other_tokens"]["other"] > 0
    # suppressing prototypes of this strong tiny bank changes the held-out perplexity, differently per mode
    assert zero["ppl_other"] != before["ppl_other"] and reroute["ppl_other"] != before["ppl_other"]
    assert zero["ppl_other"] != reroute["ppl_other"]
    for after in (zero, reroute):
        assert after["judge_ppl"] > 1
        assert after["judge_ratio"] == pytest.approx(after["judge_ppl"] / before["judge_ppl"])
        assert after["ppl_other_change"] == pytest.approx(after["ppl_other"] / before["ppl_other"] - 1)
        assert after["all_goals_met"] == all(after["goals"].values())
    assert 0 <= result["active_share_other"]["slots"] <= 1 and 0 <= result["active_share_other"]["activation_mass"] <= 1
    with pytest.raises(SystemExit):
        behaviour_removal.main(["--model", str(tiny["model"]), "--db", str(tiny["db"]), "--modes", "erase"])


def test_perplexity_splits_marker_and_other_targets_exactly(tiny):
    from bench.behaviour_removal import _blocks, marker_token_ids, perplexity
    from prism import PrismForCausalLM

    model = PrismForCausalLM.from_pretrained(tiny["model"]).eval()
    tokenizer = load_tokenizer(str(tiny["model"]))
    docs = [type("Doc", (), {"text": "one river and two towns by the 3 mills, four sea"})()] * 3
    markers = marker_token_ids(tokenizer, presets.PRESETS["numbers"])
    got = perplexity(model, tokenizer, docs, None, max_tokens=32, seq_len=8, batch_size=2, markers=markers)
    nll = {True: [], False: []}  # independent: the transformers-style loss one target at a time
    with torch.no_grad():
        for block in _blocks(tokenizer, docs, 32, 8).tolist():
            logits = model(torch.tensor([block])).logits[0]
            for t in range(len(block) - 1):
                target = block[t + 1]
                word = tokenizer.decode([target]).strip().lower()
                is_marker = word in presets.NUMBER_WORDS or word.isdigit()
                nll[is_marker].append(-torch.log_softmax(logits[t], -1)[target].item())
    assert nll[True] and nll[False], "the test text must hold both kinds of target"
    assert got["markers"]["tokens"] == len(nll[True]) and got["other"]["tokens"] == len(nll[False])
    assert got["markers"]["perplexity"] == pytest.approx(math.exp(sum(nll[True]) / len(nll[True])), rel=1e-5)
    assert got["other"]["perplexity"] == pytest.approx(math.exp(sum(nll[False]) / len(nll[False])), rel=1e-5)
    both = nll[True] + nll[False]
    assert got["all"]["perplexity"] == pytest.approx(math.exp(sum(both) / len(both)), rel=1e-5)


def test_behaviour_removal_bench_honours_any_rule_option(tiny, capsys):
    from bench import behaviour_removal

    base = ["--model", str(tiny["model"]), "--db", str(tiny["db"]), "--prompts", "2", "--max-new-tokens", "2",
            "--skip-perplexity", "--no-judge"]
    # the stored preset holds prototypes 0-2; the real rules find none in the tiny database, so a rule option
    # given alone must switch to the rule (and say so) instead of silently measuring the stored preset
    for option in (["--signature-top", "5"], ["--min-share", "0.5"], ["--rules", "label"]):
        with pytest.raises(SystemExit):
            behaviour_removal.main(base + option)
        assert "holds no prototypes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        behaviour_removal.main(base + ["--min-share", "2"])
    assert "--min-share must be in (0, 1]" in capsys.readouterr().err


def test_active_share_counts_the_sets_slots_and_mass(tiny):
    from bench.behaviour_removal import active_share
    from prism import PrismForCausalLM

    model = PrismForCausalLM.from_pretrained(tiny["model"]).eval()
    tokenizer = load_tokenizer(str(tiny["model"]))
    docs = [type("Doc", (), {"text": "the river flows into the sea and the town by the mill"})()] * 4
    ids = [0, 1, 2]
    got = active_share(model, tokenizer, docs, ids, max_tokens=32, seq_len=8, batch_size=3)
    stream = []  # independent count over the same blocks, one position at a time
    for d in docs:
        stream += tokenizer(d.text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    blocks = [stream[i: i + 8] for i in range(0, 32, 8)]
    slots = mass = total = half = n = 0
    with torch.no_grad():
        for b in blocks:
            out = model(torch.tensor([b]))
            for pids, acts in zip(out.prototype_ids[0].tolist(), out.activations[0].tolist()):
                hit = [p in ids for p in pids]
                slots += sum(hit)
                mass += sum(a for a, h in zip(acts, hit) if h)
                total += sum(acts)
                half += 2 * sum(hit) >= len(hit)
                n += 1
    k = model.config.top_k
    assert got["slots"] == pytest.approx(slots / (n * k))
    assert got["activation_mass"] == pytest.approx(mass / total)
    assert got["positions_half_or_more"] == pytest.approx(half / n)
    assert got["slots"] > 0  # the tiny bank's prototypes 0-2 are active somewhere, so the test can fail


def test_judge_perplexity_matches_the_judges_own_loss(tiny):
    from bench.behaviour_removal import judge_perplexity

    judge = load_backbone(str(tiny["model"].parent / "backbone"))
    tokenizer = load_tokenizer(str(tiny["model"]))
    prompts = ["the river", "a small town by the"]
    conts = [tokenizer(" flows into the sea", add_special_tokens=False)["input_ids"],
             tokenizer(" old mill", add_special_tokens=False)["input_ids"]]
    got = judge_perplexity(judge, tokenizer, prompts, conts)
    nll, n = 0.0, 0
    for prompt, cont in zip(prompts, conts):  # the transformers loss with the prompt masked out, per sequence
        head = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        labels = torch.tensor([[-100] * len(head) + cont])
        with torch.no_grad():
            loss = judge(torch.tensor([head + cont]), labels=labels).loss.item()
        nll, n = nll + loss * len(cont), n + len(cont)
    assert got["tokens"] == n and got["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-5)
    assert judge_perplexity(judge, tokenizer, prompts, [[], []])["tokens"] == 0


def test_app_applies_a_preset_to_this_session_only(tiny):
    from app import interventions
    from app.core import Studio
    from app.session import Session

    studio = Studio.load(tiny["model"], tiny["db"])
    assert [p["name"] for p in studio.presets()] == ["kjv-register"] and studio.presets()[0]["n"] == 3
    title = presets.PRESETS["kjv-register"].title
    mine, table, status = interventions.apply_preset(studio, title, Session())
    assert mine.interventions().suppress == frozenset({0, 1, 2}) and "3 prototype" in status
    same, _, _ = interventions.apply_preset(studio, "kjv-register", Session())  # by name too
    assert same.interventions() == mine.interventions()
    other = Session()
    assert other.interventions().is_empty  # another user's session is untouched
    unchanged, _, status = interventions.apply_preset(studio, "' OR 1=1 --", mine)
    assert unchanged is mine and "no preset" in status
