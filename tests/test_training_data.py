"""The training-data cache built on first start (app/training_data.py): a real child process builds the tiny model's
attribution cache into its own database; the panel says how far it got meanwhile and then answers exactly as a
cache built by hand into a copy of the database; a build killed mid-pass says so and the next start resumes it to
the same numbers; --attribution-holdout leaves out the documents training held out.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_app_support import build_tiny_attribution_db, free_port, shared_assets, wait_until_served

from app import training_data
from app.attribution import attribute_token, attribution_panel
from app.core import GenerationSettings, Studio
from app.session import Session
from precompute import attribution as cache
from precompute import query
from precompute.__main__ import main as precompute_main
from precompute.runs import connect
from prism.data import is_validation

PROMPT = "the cat sat on the"
# the by-hand cache's arguments (build_tiny_attribution_db): every window of 24 tokens, rank 16
ROOT = Path(__file__).resolve().parents[1]
RECIPE = dict(max_sequences=100_000, seq_len=24, holdout=0.0, rank=16, batch_size=4)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    model, db = shared_assets(tmp_path_factory)
    root = tmp_path_factory.getbasetemp() / "app_assets"
    return {"model": model, "db": db, "corpus": root / "corpus" / "corpus.jsonl",
            "by_hand": build_tiny_attribution_db(root, model, db)}


def wait_for(build: training_data.FirstStartBuild, timeout: float = 240.0) -> None:
    deadline = time.time() + timeout
    while build._proc is not None and time.time() < deadline:
        time.sleep(0.2)
    assert build._proc is None, f"the build did not end within {timeout:.0f} s"


def answers(studio: Studio, gen, index: int = 2) -> tuple[list[int], list[float]]:
    data = attribute_token(studio, gen, index, top=8)
    return [r["sequence_id"] for r in data["sequences"]], [r["score"] for r in data["sequences"]]


def test_first_start_build_answers_as_a_cache_built_by_hand(assets, tmp_path):
    recipe = training_data.Recipe(corpus=str(assets["corpus"]), **RECIPE)
    path = tmp_path / "cache" / "first.duckdb"
    studio = Studio.load(assets["model"], assets["db"])  # evidence and labels, no attribution cache
    gen = studio.generate(GenerationSettings(PROMPT, max_new_tokens=6))
    # a first run killed after the fit pass's first chunk: the panel says it stopped and where the log is
    killed = training_data.FirstStartBuild(assets["model"], recipe, path, extra=("--docs-per-chunk", "4",
                                                                                 "--hook", "kill_at=fit:2"))
    training_data.attach(studio, killed)
    killed.start()
    wait_for(killed)
    assert killed.database() is None and "exit code -9" in killed.status() and str(killed.log_path) in killed.status()
    html, data = attribution_panel(studio, "original", 2, Session(original=gen))
    assert data is None and "stopped" in html
    progress = cache.read_progress(path)
    assert progress["phase"] == "fit" and 0 < progress["done"] < progress["total"]
    # the next start resumes it (same arguments: the chunk size is part of them) and finishes
    build = training_data.FirstStartBuild(assets["model"], recipe, path, extra=("--docs-per-chunk", "4"))
    training_data.attach(studio, build)
    build.start()
    assert build.database() is None and "Building the training-data cache" in build.status()
    html, data = attribution_panel(studio, "original", 2, Session(original=gen))
    assert data is None and "Every other panel works meanwhile" in html
    wait_for(build)
    assert build.database() is not None and build.status().startswith("Training-data cache ready")
    assert cache.read_progress(path)["phase"] == "done"
    got = answers(studio, gen)
    by_hand = Studio.load(assets["model"], assets["by_hand"])
    want = answers(by_hand, gen)
    assert got[0] == want[0] and len(got[0]) == 8
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-6)
    html, data = attribution_panel(studio, "original", 2, Session(original=gen))
    assert "Training data behind token 2" in html and data["sequences"][0]["sequence_id"] == want[0][0]
    assert html.count("prism-attribution-measured") == 1 and "planted" in html  # what the recall means, once
    # a second app process on this machine finds the finished cache and starts nothing
    again = training_data.FirstStartBuild(assets["model"], recipe, path)
    again.start()
    assert again._proc is None and again.database() is not None


def test_the_shipped_kind_of_database_names_its_corpus(assets):
    """for_database builds for a database over a named corpus with no cache of its own, never for a corpus file
    (the database stores only its name) or a database that has a cache."""
    con = connect(assets["db"], read_only=True)
    try:
        built = query.built_from(con)
    finally:
        con.close()
    assert built["corpus"] == assets["corpus"].name and len(built["weights_sha256"]) == 64
    studio = Studio.load(assets["model"], assets["db"])
    assert training_data.FirstStartBuild.for_database(assets["model"], studio.db) is None
    with_cache = Studio.load(assets["model"], assets["by_hand"])
    assert training_data.FirstStartBuild.for_database(assets["model"], with_cache.db) is None
    recipe = training_data.Recipe(corpus="default-v3")
    argv = training_data.FirstStartBuild(assets["model"], recipe).command()
    assert argv[argv.index("--attribution-max-sequences") + 1] == "3072" and "--corpus" in argv
    assert training_data.FirstStartBuild.default_path(assets["model"], recipe) != \
        training_data.FirstStartBuild.default_path(assets["model"], training_data.Recipe(corpus="default"))


def test_holdout_leaves_out_the_validation_documents(assets, tmp_path):
    db = tmp_path / "held.duckdb"
    precompute_main(["build", "--model", str(assets["model"]), "--corpus", str(assets["corpus"]), "--db", str(db),
                     "--jobs", "attribution", "--seq-len", "24", "--batch-size", "4", "--attribution-rank", "8",
                     "--attribution-holdout", "0.5"])
    con = connect(db, read_only=True)
    try:
        kept = [r[0] for r in con.execute("SELECT doc_id FROM attribution_documents").fetchall()]
    finally:
        con.close()
    docs = [json.loads(line)["id"] for line in assets["corpus"].read_text().splitlines()]
    training = [d for d in docs if not is_validation(d, 0.5)]
    assert 0 < len(training) < len(docs)  # the fraction splits this corpus
    assert sorted(kept) == sorted(training)


SERVE_AND_BUILD = """
import sys
from app import training_data
from app.core import Studio
from app.ui import build_demo, launch
model, db, corpus, path, port = sys.argv[1:]
studio = Studio.load(model, db)
recipe = training_data.Recipe(corpus=corpus, max_sequences=100_000, seq_len=24, holdout=0.0, rank=16, batch_size=4)
build = training_data.FirstStartBuild(model, recipe, path, extra=("--docs-per-chunk", "1"))
training_data.attach(studio, build)
build.start()
print("child", build._proc.pid, flush=True)
launch(build_demo(studio), host="127.0.0.1", port=int(port))
"""


SERVE_STOPPED = """
import sys, time
from app import training_data
from app.core import Studio
from app.ui import build_demo, launch
model, db, corpus, path, port = sys.argv[1:]
studio = Studio.load(model, db)
recipe = training_data.Recipe(corpus=corpus, max_sequences=100_000, seq_len=24, holdout=0.0, rank=16, batch_size=4)
build = training_data.FirstStartBuild(model, recipe, path, extra=("--docs-per-chunk", "4", "--hook", "kill_at=fit:2"))
training_data.attach(studio, build)
build.start()
while build._proc is not None:
    time.sleep(0.2)
launch(build_demo(studio), host="127.0.0.1", port=int(port))
"""


@pytest.mark.slow
def test_the_panel_shows_the_builds_line_once(assets, tmp_path, browser):
    """While the first-start cache is not ready the attribution panel holds its one line, before any click (each
    page load reads it) and as a click's answer, never a second copy beside it (the page's timer refreshes that
    same line). A build killed mid-pass keeps the line fixed: it says it stopped and where its log is."""
    port = free_port()
    log = (tmp_path / "app.log").open("w")
    proc = subprocess.Popen([sys.executable, "-c", SERVE_STOPPED, str(assets["model"]), str(assets["db"]),
                             str(assets["corpus"]), str(tmp_path / "cache" / "stopped.duckdb"), str(port)], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_served(proc, url, 120, lambda: (tmp_path / "app.log").read_text()[-3000:])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        page.goto(url)
        page.wait_for_selector("#attribution")
        page.wait_for_function("document.querySelector('#attribution').innerText.includes('exit code -9')")
        assert page.inner_text("body").count("exit code -9") == 1
        page.fill("#prompt textarea", PROMPT)
        page.click("#generate")
        page.wait_for_function("document.querySelector('#gen-status').innerText.includes('Generated')")
        page.locator("#original .textfield .token").nth(1).click()
        page.wait_for_function("document.querySelector('#token-summary').innerText.includes('Token 1')")
        page.wait_for_timeout(6000)  # one tick of the page's timer (5 s) after the click's answer
        assert page.locator("#attribution .prism-attribution-building").count() == 1
        assert page.inner_text("body").count("exit code -9") == 1
        page.close()
    finally:
        proc.kill()
        proc.wait(timeout=30)
        log.close()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_kill_ends_the_app_and_its_cache_build(assets, tmp_path):
    """SIGTERM to a serving app (what `kill`, a Space or a service manager sends) closes it as Ctrl-C does: the
    training-data child it started stops with it instead of living on alone (app.ui.stop_on_sigterm)."""
    port = free_port()
    path = tmp_path / "cache" / "served.duckdb"
    log = (tmp_path / "app.log").open("w")
    proc = subprocess.Popen([sys.executable, "-c", SERVE_AND_BUILD, str(assets["model"]), str(assets["db"]),
                             str(assets["corpus"]), str(path), str(port)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=log, text=True)
    child = None
    try:
        child = int(proc.stdout.readline().split()[1])
        wait_until_served(proc, f"http://127.0.0.1:{port}", 120, lambda: (tmp_path / "app.log").read_text()[-3000:])
        assert _alive(child), "the build ended before the app was stopped: nothing left to check"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        deadline = time.time() + 20
        while _alive(child) and time.time() < deadline:
            time.sleep(0.2)
        assert not _alive(child), "the training-data child outlived its app"
    finally:
        if proc.poll() is None:
            proc.kill()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)
        log.close()
