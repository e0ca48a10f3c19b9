"""The benchmark scripts run end to end on a tiny model (their numbers are only meaningful on real ones)."""

from __future__ import annotations

import importlib.util
import statistics
import time
from pathlib import Path

import pytest
import torch
from helpers import tiny_backbone_dir, write_corpus

from prism import memory

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_throughput_bench_times_both_models_on_the_same_steps(tmp_path, capsys):
    bench = _load("train_throughput")
    result = bench.main(["--backbone", str(tiny_backbone_dir(tmp_path / "bb")), "--corpus",
                         str(write_corpus(tmp_path / "c")), "--n-layers", "1", "--n-prototypes", "16",
                         "--top-k", "4", "--seq-len", "32", "--batch-size", "2", "--repeats", "3"])
    assert result["prism_s_per_step"] > 0 and result["dense_s_per_step"] > 0
    assert result["prism_tokens_per_s"] * result["prism_s_per_step"] == pytest.approx(2 * 32)  # batch x seq_len
    assert '"throughput_ratio"' in capsys.readouterr().out
    m = result["machine"]  # what the ratio depends on, recorded with it
    assert m["cpu"] and m["threads"] == torch.get_num_threads() and set(m["extensions"]) <= set(bench.EXTENSIONS)
    assert m["torch_capability"] == torch.backends.cpu.get_cpu_capability() and result["precision"] == "float32"
    assert m["allocator"] == memory.allocator()
    for name in ("prism", "dense"):  # every timed step, in order, with the fresh pages it touched
        steps = result["steps"][name]
        assert len(steps["s"]) == len(steps["page_faults"]) == 3 and min(steps["page_faults"]) >= 0
        assert statistics.median(steps["s"]) == pytest.approx(result[f"{name}_s_per_step"], abs=1e-4)
    with_path = bench.main(["--backbone", str(tmp_path / "bb"), "--corpus", str(tmp_path / "c" / "corpus.jsonl"),
                            "--n-layers", "1", "--n-prototypes", "16", "--top-k", "4", "--seq-len", "32",
                            "--batch-size", "2", "--repeats", "2", "--lambda-path-kl", "1", "--lambda-head-rec", "0.5"])
    assert (with_path["lambda_path_kl"], with_path["lambda_head_rec"], with_path["lambda_path_ce"]) == (1.0, 0.5, 0.0)
    with pytest.raises(SystemExit):
        bench.main(["--corpus", "x", "--lambda-path-kl", "-1"])
    common = ["--backbone", str(tmp_path / "bb"), "--corpus", str(tmp_path / "c" / "corpus.jsonl"), "--n-layers", "1",
              "--top-k", "4", "--seq-len", "32", "--batch-size", "2", "--repeats", "3"]
    wide = bench.main([*common, "--n-prototypes", "100"])  # more prototypes than one batch has tokens (64)
    assert wide["n_prototypes"] == 100 and wide["prism_s_per_step"] > 0
    with pytest.raises(SystemExit):  # more than all five batches hold (320 tokens): a message, not a traceback
        bench.main([*common, "--n-prototypes", "1000"])


def test_train_throughput_bench_times_the_model_it_names(tmp_path, monkeypatch):
    """A PRISM step made 0.2 s slower (the dense one left alone) shows up in PRISM's time and in the ratio, and
    only there: the timer measures each model's own steps."""
    from prism.train import TrainModule

    bench = _load("train_throughput")
    argv = ["--backbone", str(tiny_backbone_dir(tmp_path / "bb")), "--corpus", str(write_corpus(tmp_path / "c")),
            "--n-layers", "1", "--n-prototypes", "16", "--top-k", "4", "--seq-len", "32", "--batch-size", "2",
            "--repeats", "3"]
    plain = bench.main(argv)
    forward = TrainModule.forward

    def slower_prism(self, ids, states):
        if not self.args.dense_baseline:
            time.sleep(0.5)  # large beside the noise of a loaded machine (two busy cores slowed steps by ~0.1 s)
        return forward(self, ids, states)

    monkeypatch.setattr(TrainModule, "forward", slower_prism)
    slowed = bench.main(argv)
    assert slowed["prism_s_per_step"] - slowed["dense_s_per_step"] >= 0.35
    assert slowed["throughput_ratio"] < plain["throughput_ratio"] and slowed["throughput_ratio"] < 1
    assert slowed["ratio_per_pair_median"] < 1


def test_train_throughput_bench_compares_autocast_on_the_same_steps(tmp_path):
    bench = _load("train_throughput")
    result = bench.main(["--backbone", str(tiny_backbone_dir(tmp_path / "bb")), "--corpus",
                         str(write_corpus(tmp_path / "c")), "--n-layers", "1", "--n-prototypes", "16",
                         "--top-k", "4", "--seq-len", "32", "--batch-size", "2", "--repeats", "3",
                         "--autocast-compare", "--force-bfloat16", "--profile", "3", "--release-freed-memory"])
    assert set(result["profile"]) == {"prism", "dense", "prism_bf16", "dense_bf16"}  # both precisions profiled
    assert all(len(rows) == 3 and rows[0]["self_ms_per_step"] >= rows[-1]["self_ms_per_step"]
               for rows in result["profile"].values())
    ac = result["autocast"]
    assert ac["prism_bf16_s_per_step"] > 0 and ac["dense_bf16_s_per_step"] > 0 and ac["cache_fill_speedup"] > 0


def test_train_throughput_bench_skips_bfloat16_where_it_is_emulated(tmp_path, monkeypatch, caplog):
    """On a CPU without native bfloat16 (AVX2 only) a bfloat16 step is tens of times slower: --autocast-compare
    times float32 alone there and says so, in the result and in the log."""
    bench = _load("train_throughput")
    monkeypatch.setattr(bench, "native_bfloat16", lambda device="cpu": False)  # what an AVX2-only CPU answers
    result = bench.main(["--backbone", str(tiny_backbone_dir(tmp_path / "bb")), "--corpus",
                         str(write_corpus(tmp_path / "c")), "--n-layers", "1", "--n-prototypes", "16",
                         "--top-k", "4", "--seq-len", "32", "--batch-size", "2", "--repeats", "2",
                         "--autocast-compare", "--profile", "2"])
    assert set(result["steps"]) == set(result["profile"]) == {"prism", "dense"}  # no bfloat16 model ran
    assert "emulates bfloat16" in result["autocast"]["skipped"] and result["prism_s_per_step"] > 0
    assert "--force-bfloat16" in caplog.text

