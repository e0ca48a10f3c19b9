"""recipes.release: the v2 recipe's driver, on a tiny model and corpus (the stages up to eval; the later stages
are the precompute and ship commands other tests cover)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import tiny_backbone_dir, write_corpus

from prism import train as train_module
from prism.train import resolve_autocast
from recipes.release import STAGES, main


def _argv(tmp_path: Path, backbone: str, corpus: str, *extra: str) -> list[str]:
    return ["--out", str(tmp_path / "rel"), "--corpus", corpus, "--backbone", backbone, "--tokens", "256",
            "--seq-len", "32", "--batch-size", "4", "--n-prototypes", "16", "--top-k", "4", "--n-layers", "1",
            "--val-tokens", "64", "--max-source-share", "1.0", *extra]


def test_dry_run_lists_every_stage_and_runs_nothing(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "rel"), "--dry-run"]) == {}
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("]")[0][1:] for line in lines] == ["corpus", "corpus", *STAGES[1:6], *["controllers"] * 3,
                                                           "ship"]
    prism = next(line for line in lines if line.startswith("[prism]"))
    dense = next(line for line in lines if line.startswith("[dense]"))
    # the baseline is the PRISM run's command with --dense-baseline and its own folder: same data, steps, precision
    assert dense.replace("[dense]", "").replace(" --dense-baseline", "").replace("/dense", "/prism") == \
        prism.replace("[prism]", "")
    assert f"--autocast {resolve_autocast('auto')}" in prism and "--lambda-r1 1.0 --lambda-r2 1.0" in prism
    assert "--steps 1001" in prism  # 2.05M tokens / (8 x 256)
    # the shipped controller is fitted again for the new bank and shipped from where the fit writes it
    fit = next(line for line in lines if line.startswith("[controllers]") and " fit " in line)
    ship = next(line for line in lines if line.startswith("[ship]"))
    assert f"--checkpoint {tmp_path}/rel/prism/final" in fit and "--seeds 0" in fit
    assert f"--controller next_sentence={tmp_path}/rel/controllers/next_sentence/prototype-seed0.safetensors" in ship
    assert not (tmp_path / "rel").exists()
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "rel"), "--dry-run", "--controller-seeds", "0,x"])
    # --init-balance reaches the PRISM run only (the baseline has no bank); otherwise the two stay identical
    main(["--out", str(tmp_path / "rel"), "--dry-run", "--init-balance", "0.25"])
    lines = capsys.readouterr().out.splitlines()
    prism = next(line for line in lines if line.startswith("[prism]"))
    dense = next(line for line in lines if line.startswith("[dense]"))
    assert "--init-balance 0.25" in prism and "--init-balance" not in dense
    assert dense.replace("[dense]", "").replace(" --dense-baseline", "").replace("/dense", "/prism") == \
        prism.replace("[prism]", "").replace(" --init-balance 0.25", "")
    with pytest.raises(SystemExit):  # refused before any stage, as prism.train would refuse it
        main(["--out", str(tmp_path / "rel"), "--dry-run", "--init-balance", "-1"])
    # so do the path terms (issue 35's --lambda-path-kl 1): the PRISM run only, bad values refused
    main(["--out", str(tmp_path / "rel"), "--dry-run", "--lambda-path-kl", "1", "--lambda-path-ce", "0.5"])
    lines = capsys.readouterr().out.splitlines()
    prism = next(line for line in lines if line.startswith("[prism]"))
    dense = next(line for line in lines if line.startswith("[dense]"))
    assert "--lambda-path-kl 1.0 --lambda-path-ce 0.5" in prism and "--lambda-path" not in dense
    for bad in ("-1", "nan"):
        with pytest.raises(SystemExit):
            main(["--out", str(tmp_path / "rel"), "--dry-run", "--lambda-path-kl", bad])
    assert not (tmp_path / "rel").exists()


@pytest.mark.parametrize("native", [True, False])
def test_precision_follows_the_machine_and_a_started_release_keeps_its_own(tmp_path, capsys, monkeypatch, native):
    """--autocast auto: bfloat16 only where the machine runs it natively and faster (an AVX2-only CPU emulates it
    about 50x slower); a release that already started keeps the precision it recorded, so its dense baseline matches."""
    monkeypatch.setattr(train_module, "native_bfloat16", lambda device="cpu": native)
    monkeypatch.setattr(train_module, "fast_bfloat16", lambda device="cpu": native)
    main(["--out", str(tmp_path / "rel"), "--dry-run"])
    prism = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("[prism]"))
    assert f"--autocast {'bfloat16' if native else 'none'}" in prism
    (tmp_path / "rel").mkdir()
    (tmp_path / "rel" / "release_args.json").write_text(json.dumps({"autocast": "none" if native else "bfloat16"}))
    main(["--out", str(tmp_path / "rel"), "--dry-run"])
    lines = capsys.readouterr().out.splitlines()
    assert all(f"--autocast {'none' if native else 'bfloat16'}" in line for line in lines
               if line.startswith(("[prism]", "[dense]")))
    main(["--out", str(tmp_path / "rel"), "--dry-run", "--autocast", "none"])  # asked for explicitly: that one
    assert "--autocast none" in next(line for line in capsys.readouterr().out.splitlines()
                                     if line.startswith("[dense]"))


@pytest.mark.slow
def test_stages_run_resume_and_summarise(tmp_path, capsys):
    backbone = str(tiny_backbone_dir(tmp_path / "bb"))
    corpus = str(write_corpus(tmp_path / "c"))
    argv = _argv(tmp_path, backbone, corpus, "--stages", "corpus,prism,dense,eval")
    result = main(argv)
    out = tmp_path / "rel"
    assert set(result["stages"]) == set(STAGES)
    assert all(result["stages"][s] is not None for s in ("corpus", "prism", "dense", "eval"))
    assert result["stages"]["build"] is None
    # the summary reads the evaluation prism.eval wrote, and judges it against the goals
    ev = json.loads((out / "eval.json").read_text())
    assert result["eval"]["r1_bar"] == ev["prism"]["r1_bar"] and result["eval"]["ce_gap"] == ev["prism_vs_dense_ce"]
    assert result["goals_met"]["r1_bar"] == (ev["prism"]["r1_bar"] >= 0.94)
    assert result["training_tokens"] == sum(json.loads((out / "prism" / "corpus_mix.json").read_text())
                                            ["after"].values())
    assert json.loads((out / "summary.json").read_text()) == result
    # run again: finished stages are skipped (their logs do not grow); --redo runs one again
    sizes = {p.name: p.stat().st_size for p in (out / "logs").iterdir()}
    main(argv)
    assert {p.name: p.stat().st_size for p in (out / "logs").iterdir()} == sizes
    main(argv + ["--redo", "eval"])
    assert (out / "logs" / "eval.log").stat().st_size > sizes["eval.log"]
    assert (out / "logs" / "prism.log").stat().st_size == sizes["prism.log"]
    capsys.readouterr()


@pytest.mark.slow
def test_a_failing_stage_stops_with_a_clear_error_and_no_record(tmp_path, capsys):
    corpus = str(write_corpus(tmp_path / "c"))
    argv = _argv(tmp_path, str(tmp_path / "no-backbone"), corpus, "--stages", "corpus,prism")
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and "stage prism failed" in capsys.readouterr().err
    out = tmp_path / "rel"
    assert (out / "stages" / "corpus.json").exists() and not (out / "stages" / "prism.json").exists()
    with pytest.raises(SystemExit):
        main(argv + ["--stages", "corpus,sideways"])
    assert "unknown stage" in capsys.readouterr().err
