"""Builders shared by the app tests (no tests here): a tiny PRISM model and a full precompute database in a folder.

The model is a random tiny Llama with prototypes spread over real directions; the database holds every job
(evidence, labels, search, map) run on the synthetic corpus of tests/helpers.py. Nothing reaches a hub.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from helpers import tiny_backbone_dir, write_corpus

from precompute.__main__ import main as precompute_main
from prism import PrismConfig, PrismForCausalLM
from prism.backbones import load_backbone, load_tokenizer

N_PROTOTYPES, TOP_K = 24, 4
ROOT = Path(__file__).resolve().parents[1]
CHANGED_RGB = "rgba(255, 45, 45"  # app/ui.py's colour of a token the interventions changed (#ff2d2d), as drawn


def build_tiny_model(root: Path, seed: int = 0) -> Path:
    """A saved tiny PRISM model (with tokenizer) under root/model; reused when already there."""
    out = root / "model"
    if (out / "config.json").is_file():
        return out
    backbone_dir = tiny_backbone_dir(root / "backbone", seed=seed)
    model = PrismForCausalLM.from_backbone(load_backbone(str(backbone_dir)),
                                           PrismConfig(n_prototypes=N_PROTOTYPES, top_k=TOP_K))
    torch.manual_seed(seed)
    with torch.no_grad():
        model.prototypes.weight.normal_()
        # a stronger bank than the tiny backbone's states: suppressing a prototype visibly changes the output
        model.prototypes.weight.mul_(30.0)
    model.save_pretrained(out)
    load_tokenizer(str(backbone_dir)).save_pretrained(out)
    return out


def build_tiny_db(root: Path, model: Path) -> Path:
    """Every precompute job on the synthetic corpus, into root/tiny.duckdb; reused when already there."""
    db = root / "tiny.duckdb"
    done = root / "tiny.done"
    if done.is_file():
        return db
    corpus = write_corpus(root / "corpus", n_docs=30)
    precompute_main(["build", "--model", str(model), "--corpus", str(corpus), "--db", str(db), "--top-n", "4",
                     "--seq-len", "24", "--batch-size", "4"])
    done.write_text(json.dumps({"db": str(db)}))
    return db


def shared_assets(tmp_path_factory) -> tuple[Path, Path]:
    """(model folder, database) built once per pytest session and shared by the app test modules."""
    root = tmp_path_factory.getbasetemp() / "app_assets"
    root.mkdir(exist_ok=True)
    model = build_tiny_model(root)
    return model, build_tiny_db(root, model)


def changing_prototype(studio, settings, mode: str = "zero") -> int:
    """A prototype whose suppression (in `mode`) changes the continuation of `settings` (the tiny model has
    several); the test fails when there is none."""
    import pytest

    from app.core import side_by_side
    from prism import Interventions

    original = studio.generate(settings)
    for pid in range(studio.n_prototypes):
        gen = studio.generate(settings, Interventions(suppress={pid}, suppress_mode=mode))
        if side_by_side(original, gen).first_change is not None:
            return pid
    pytest.fail("no single prototype changes the tiny model's text")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_app(model: Path, db: Path | None, concurrency: int = 2, timeout: float = 120.0, extra: tuple = ()):
    """`python app.py` (with `extra` flags) in a subprocess on a free 127.0.0.1 port; yields its URL, stops it
    afterwards."""
    port = free_port()
    argv = [sys.executable, str(ROOT / "app.py"), "--model", str(model), "--port", str(port),
            "--concurrency", str(concurrency), *extra]
    if db is not None:
        argv += ["--db", str(db)]
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1"}
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def exited() -> str:
        log.seek(0)
        return f"app.py exited with {proc.returncode}:\n{log.read().decode()[-3000:]}"

    try:
        wait_until_served(proc, url, timeout, exited)
        yield url
    finally:
        stop_process(proc, log)


def wait_until_served(proc: subprocess.Popen, url: str, timeout: float, exited) -> None:
    """Poll `url` until it answers 200; RuntimeError(exited()) if the server process ends first, TimeoutError after
    `timeout` seconds."""
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(exited())
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.time() > deadline:
            raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")
        time.sleep(0.5)


def stop_process(proc: subprocess.Popen, log) -> None:
    """End a server started for a test (terminate, then kill after 20 s) and close its log."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def build_tiny_controller(studio, folder: Path, prompt: str, tokens: int):
    """A prototype controller file for the tiny model that changes the greedy continuation of `prompt`: it lowers
    the prototypes one generated token leans on most and raises two others. Returns (path, controller)."""
    from app.core import GenerationSettings, side_by_side
    from prism import Interventions
    from prism.controllers import PrototypeController, bank_fingerprint, save_controller

    settings = GenerationSettings(prompt, max_new_tokens=tokens)
    original = studio.generate(settings)
    n = studio.n_prototypes
    for first in range(tokens):
        log_factors = torch.zeros(n)
        lowered = original.steps[first].prototype_ids[:2]
        log_factors[lowered] = -2.0
        raised = [p for p in range(n) if p not in lowered][first % (n - 2): first % (n - 2) + 2]
        log_factors[raised] = 1.5
        controller = PrototypeController(log_factors, {"task": "next_sentence", "seed": 0,
                                                       "bank_fingerprint": bank_fingerprint(studio.model)})
        changed = studio.generate(settings, Interventions(controller=controller))
        if side_by_side(original, changed).first_change is not None:
            path = save_controller(controller, folder / "next_sentence" / "prototype-seed0.safetensors")
            return path, controller
    raise RuntimeError("no test controller changes the continuation")


def build_tiny_attribution_db(root: Path, model: Path, db: Path) -> Path:
    """A copy of the tiny database with the attribution cache added (precompute/attribution/), as
    root/tiny-attribution.duckdb; reused when already there. The shared database stays as it is."""
    import shutil

    out = root / "tiny-attribution.duckdb"
    done = root / "tiny-attribution.done"
    if done.is_file():
        return out
    out.unlink(missing_ok=True)
    shutil.copyfile(db, out)
    precompute_main(["build", "--model", str(model), "--corpus", str(root / "corpus" / "corpus.jsonl"), "--db",
                     str(out), "--jobs", "attribution", "--seq-len", "24", "--batch-size", "4",
                     "--attribution-rank", "16"])
    done.write_text(json.dumps({"db": str(out)}))
    return out
