"""The label benchmarks of issue 37 on real small parts: bench.label_detection (offline scores, the intruder check,
the LLM scorer against a local chat endpoint) and bench.label_relevance (a tiny PRISM model, its own database)."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch
from sklearn.metrics import roc_auc_score
from test_app_support import shared_assets
from test_contrast import PROTOTYPES
from test_labels import build_evidence_db

from bench import label_detection, label_relevance
from precompute import labels as labels_job
from precompute.labels.detection import parse_claims
from precompute.runs import connect


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    path = build_evidence_db(tmp_path_factory.mktemp("bench-labels") / "db.duckdb", prototypes=PROTOTYPES,
                             dead=(5,), n_evidence=12)
    con = connect(path)
    labels_job.run(con, batch_size=3)
    con.close()
    return path


def test_parse_fires_reads_json_or_numbers_in_range():
    assert label_detection.parse_fires('{"fires": [1, 3, 9]}', 5) == {1, 3}
    assert label_detection.parse_fires("contexts 2 and 4 fit", 5) == {2, 4}
    assert label_detection.parse_fires('```json\n{"fires": ["2"]}\n```', 3) == {2}
    assert label_detection.parse_fires("none of them", 3) == set()


def test_offline_scores_match_the_stored_ones(labelled, capsys):
    result = label_detection.main(["--db", str(labelled)])
    con = connect(labelled, read_only=True)
    try:
        stored = con.execute("SELECT avg(detection_random), avg(detection_sibling) FROM labels "
                             "WHERE detection_random IS NOT NULL").fetchone()
    finally:
        con.close()
    assert result["marked"]["detection_random"] == pytest.approx(stored[0], abs=1e-4)
    assert result["marked"]["detection_sibling"] == pytest.approx(stored[1], abs=1e-4)
    assert 0.0 <= result["embedding"]["detection_random"] <= 1.0
    assert result["intruder"]["prototypes"] == len(PROTOTYPES) and result["intruder"]["chance"] == 0.2
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["db"] == str(labelled)


class _Scorer(BaseHTTPRequestHandler):
    """A chat endpoint that says a context fits when its marked token is one the explanation names (a stand-in for
    an LLM that reads the label; it answers from the prompt alone, so what the test checks is the bench's
    bookkeeping of which numbered context is whose)."""

    prompts: list[str] = []
    everything = False  # answer every context

    def do_POST(self):  # noqa: N802 - the http.server name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][-1]["content"]
        type(self).prompts.append(prompt)
        explanation = re.search(r"Explanation: (.*)", prompt).group(1)
        claims = parse_claims(explanation)

        def fits(text: str) -> bool:  # the marked token is named, and so is the word after it, if the label says
            token, after = re.search(r"«([^»]*)»\s*(\S*)", text).groups()
            after = after.strip(",.;:")
            pushed = not (claims.before or claims.before_kinds) or after.lower() in claims.before or (
                "proper noun" in claims.before_kinds and after[:1].isupper())
            return token.strip().lower() in claims.tokens and pushed

        fires = [int(n) for n, text in re.findall(r"^(\d+)\. (.*)$", prompt, re.MULTILINE)
                 if type(self).everything or fits(text)]
        reply = json.dumps({"choices": [{"message": {"content": json.dumps({"fires": fires})}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


def test_llm_scorer_balanced_accuracy_from_the_endpoints_answers(labelled):
    server = HTTPServer(("127.0.0.1", 0), _Scorer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        result = label_detection.main(["--db", str(labelled), "--endpoint", url, "--llm-model", "judge",
                                       "--limit", "3", "--seed", "1"])
    finally:
        server.shutdown()
        server.server_close()
    llm = result["llm"]
    assert llm["prototypes"] == 3 and llm["failed"] == 0 and len(_Scorer.prompts) == 3
    assert all("«" in p and "Explanation: " in p for p in _Scorer.prompts)
    # a scorer that reads the label's tokens tells these made-up prototypes' contexts from random ones ...
    assert llm["detection_random"] >= 0.75, llm
    # ... and one that says yes to everything scores chance, whatever the contexts
    _Scorer.everything = True
    try:
        server = HTTPServer(("127.0.0.1", 0), _Scorer)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        always = label_detection.main(["--db", str(labelled), "--endpoint", url, "--llm-model", "judge",
                                       "--limit", "3"])["llm"]
    finally:
        _Scorer.everything = False
        server.shutdown()
        server.server_close()
    assert always["detection_random"] == 0.5 and always["detection_sibling"] in (None, 0.5)


def test_llm_scorer_needs_both_arguments(labelled, capsys):
    with pytest.raises(SystemExit) as exit_info:
        label_detection.main(["--db", str(labelled), "--endpoint", "http://127.0.0.1:9/v1"])
    assert exit_info.value.code == 2 and "--llm-model" in capsys.readouterr().err


def test_label_relevance_on_a_tiny_model(tmp_path_factory):
    """The explaining prototypes are the top positive contributions of model.decompose at each position, and the
    AUROC is sklearn's over the same cosines."""
    from precompute.embed import embed
    from prism import PrismForCausalLM
    from prism.backbones import load_tokenizer
    from prism.eval import probe_sequences

    model_dir, db = shared_assets(tmp_path_factory)
    model = PrismForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = load_tokenizer(str(model_dir))
    con = connect(db, read_only=True)
    try:
        labels = label_relevance.load_labels(con)
    finally:
        con.close()
    kind, seq = probe_sequences(tokenizer, model.max_length)[0]
    ids = torch.as_tensor(seq)[None, :12]
    rows = label_relevance.explaining(model, ids, 2)
    for t, pids, _ in rows[:5]:
        d = model.decompose(ids[:, :t + 1], position=t)
        top = [p for c, p in sorted(zip(d.contributions, d.prototype_ids, strict=True), reverse=True) if c > 0][:2]
        assert pids == top
    items = label_relevance.collect(model, tokenizer, labels, top=2, seed=0)
    result = label_relevance.score(items, labels)
    assert result["positions"] == len(items) > 0 and kind in result
    # independently: embed each label and context again, sklearn's AUROC over the same pairs
    texts = sorted({labels[p] for _, _, a, b, _ in items for p in a + b} | {c for _, c, _, _, _ in items})
    vector = dict(zip(texts, embed(texts, progress=False), strict=True))
    y, s = [], []
    for _, context, explaining_ids, random_ids, _ in items:
        for pids, truth in ((explaining_ids, 1), (random_ids, 0)):
            for p in pids:
                y.append(truth)
                s.append(float(vector[labels[p]] @ vector[context]))
    assert result["auroc"] == pytest.approx(roc_auc_score(y, s), abs=1e-3)
