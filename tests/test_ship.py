"""Shipping a default: trainable-only weights, tokenizer, provenance in the config, a pointer-only database; refusals
for a full checkpoint, a database of another model and an existing target."""

from __future__ import annotations

import json

import pytest
from helpers import tiny_backbone_dir, write_corpus

from precompute.__main__ import main as precompute_main
from precompute.runs import connect
from precompute.ship import main as ship_main
from prism import PrismConfig, PrismForCausalLM
from prism.backbones import load_backbone, load_tokenizer


def _trainable_only(root, seed=0):
    backbone_dir = tiny_backbone_dir(root / "backbone", seed=seed)
    model = PrismForCausalLM.from_backbone(load_backbone(str(backbone_dir)),
                                           PrismConfig(n_prototypes=12, top_k=3, backbone=str(backbone_dir)))
    model.requires_grad_(False)
    model.prototypes.requires_grad_(True)
    out = root / "run" / "final"
    model.save_pretrained(out, trainable_only=True)
    load_tokenizer(str(backbone_dir)).save_pretrained(out)
    (root / "run" / "train_args.json").write_text(json.dumps({"mode": "prototypes", "n_layers": 2, "steps": 3,
                                                              "batch_size": 2, "seq_len": 8, "top_k": 3}))
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("ship")
    model = _trainable_only(root)
    corpus = write_corpus(root / "corpus", n_docs=12)
    db = root / "full.duckdb"
    precompute_main(["build", "--model", str(model), "--corpus", str(corpus), "--db", str(db), "--jobs", "evidence",
                     "--top-n", "3", "--seq-len", "24", "--batch-size", "4"])
    return {"root": root, "model": model, "db": db}


def test_ship_writes_a_lean_pointer_only_default(built, tmp_path):
    out = tmp_path / "assets"
    result = ship_main(["--model", str(built["model"]), "--db", str(built["db"]), "--out", str(out)])
    assert set(result["files"]) >= {"model/config.json", "model/model.safetensors", "model/tokenizer.json",
                                    "prism-default.duckdb"}
    meta = json.loads((out / "model" / "config.json").read_text())
    shipped = meta["metadata"]["shipped"]
    assert shipped["corpus"]["sha256"] and shipped["training"]["tokens_seen"] == 3 * 2 * 8
    assert (out / "model" / "model.safetensors").read_bytes() == (built["model"] / "model.safetensors").read_bytes()
    con = connect(out / "prism-default.duckdb", read_only=True)
    assert con.execute("SELECT count(*) FROM documents WHERE text IS NOT NULL").fetchone()[0] == 0
    assert con.execute("SELECT count(*) FROM documents").fetchone()[0] > 0
    assert con.execute("SELECT count(*) FROM prototypes").fetchone()[0] == 12  # views survive the compaction
    assert con.execute("SELECT value FROM meta WHERE key = 'pointer_only'").fetchone()[0] == "true"
    con.close()
    # the shipped folder loads like any checkpoint and gives the same logits as the original
    a, b = PrismForCausalLM.from_pretrained(out / "model"), PrismForCausalLM.from_pretrained(built["model"])
    ids = load_tokenizer(str(out / "model"))("the river", return_tensors="pt").input_ids
    assert (a(ids).logits == b(ids).logits).all()


def test_ship_refusals(built, tmp_path, capsys):
    out = tmp_path / "assets"
    ship_main(["--model", str(built["model"]), "--db", str(built["db"]), "--out", str(out)])
    with pytest.raises(SystemExit):
        ship_main(["--model", str(built["model"]), "--db", str(built["db"]), "--out", str(out)])
    assert "--overwrite" in capsys.readouterr().err
    ship_main(["--model", str(built["model"]), "--db", str(built["db"]), "--out", str(out), "--overwrite"])
    other = _trainable_only(tmp_path / "other", seed=1)
    with pytest.raises(SystemExit):
        ship_main(["--model", str(other), "--db", str(built["db"]), "--out", str(tmp_path / "x")])
    assert "another model" in capsys.readouterr().err
    full = tmp_path / "full"
    PrismForCausalLM.from_pretrained(built["model"]).save_pretrained(full)
    with pytest.raises(SystemExit):
        ship_main(["--model", str(full), "--db", str(built["db"]), "--out", str(tmp_path / "y")])
    assert "full checkpoint" in capsys.readouterr().err


def _controller_for(model_dir, path, seed=0):
    """A prototype controller saved with the bank fingerprint of the model in model_dir (what bench.controllers
    fit writes)."""
    import torch

    from prism.controllers import PrototypeController, bank_fingerprint, save_controller

    model = PrismForCausalLM.from_pretrained(model_dir)
    log_factors = torch.linspace(-1, 1, model.config.n_prototypes) * (seed + 1)
    return save_controller(PrototypeController(log_factors, {"task": "t", "seed": seed,
                                                             "bank_fingerprint": bank_fingerprint(model)}), path)


def test_ship_checks_and_copies_controllers_and_drops_those_of_another_model(built, tmp_path, capsys):
    out = tmp_path / "assets"
    mine = _controller_for(built["model"], tmp_path / "mine.safetensors")
    other_model = _trainable_only(tmp_path / "other", seed=1)
    theirs = _controller_for(other_model, tmp_path / "theirs.safetensors")
    base = ["--model", str(built["model"]), "--db", str(built["db"]), "--out", str(out)]
    # a controller of another model, a bad name, a missing file: refused, nothing written
    for extra, message in ((["--controller", f"ctl={theirs}"], "another checkpoint"),
                           (["--controller", f"../x={mine}"], "NAME=FILE"),
                           (["--controller", f"ctl={tmp_path / 'none.safetensors'}"], "no file"),
                           (["--controller", f"a={mine}", "--controller", f"a={mine}"], "twice")):
        with pytest.raises(SystemExit):
            ship_main(base + extra)
        assert message in capsys.readouterr().err
        assert not out.exists()
    result = ship_main(base + ["--controller", f"next_sentence={mine}"])
    assert result["controllers"] == ["next_sentence"] and result["controllers_removed"] == []
    assert (out / "controllers" / "next_sentence.safetensors").read_bytes() == mine.read_bytes()
    # a stale controller of another model in the folder (the previous default's): removed on --overwrite,
    # one that still belongs to the shipped model is kept
    (out / "controllers" / "old.safetensors").write_bytes(theirs.read_bytes())
    result = ship_main(base + ["--overwrite"])
    assert result["controllers_removed"] == ["old"]
    assert sorted(p.name for p in (out / "controllers").iterdir()) == ["next_sentence.safetensors"]
    # re-shipping another model over it removes the first model's controller as well
    other_db = tmp_path / "other.duckdb"
    corpus = write_corpus(tmp_path / "corpus", n_docs=6)
    precompute_main(["build", "--model", str(other_model), "--corpus", str(corpus), "--db", str(other_db),
                     "--jobs", "evidence", "--top-n", "3", "--seq-len", "24", "--batch-size", "4"])
    result = ship_main(["--model", str(other_model), "--db", str(other_db), "--out", str(out), "--overwrite",
                        "--controller", f"theirs={theirs}"])
    assert result["controllers_removed"] == ["next_sentence"]
    assert sorted(p.name for p in (out / "controllers").iterdir()) == ["theirs.safetensors"]
