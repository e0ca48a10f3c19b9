"""The labels job on a clearly synthetic evidence database: categories, held-out scores, resume after SIGKILL,
argument refusal, the OpenAI-compatible and local labelers, the command line.

`build_evidence_db` writes made-up evidence (years like ' 1843', pieces like 'tion', ' thee', web addresses, ...)
into a fresh database through precompute.runs, the way the evidence job leaves it; test_search_map.py uses it too.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from precompute import labels as labels_job
from precompute.labels import (
    LabelerError,
    LabelResult,
    LocalInstructLabeler,
    OfflineLabeler,
    OpenAICompatibleLabeler,
    auroc,
    load_cards,
    normalize_category,
    parse_reply,
    token_kind,
)
from precompute.labels.__main__ import main as labels_main
from precompute.runs import JobArgsMismatch, connect, finish_job, start_job
from precompute.schema import CATEGORIES

ROOT = Path(__file__).resolve().parents[1]
N_EVIDENCE = 10


# ----------------------------------------------------------------------------------------------------------------
# The synthetic evidence: each prototype is a generator of (context tokens, index of the evidence token).


def _year(rng):
    lead = rng.choice([[" the", " treaty", " was", " signed", " in"], [" born", " in"], [" by", " the", " end", " of"],
                       [" until"], [" the", " winter", " of"]])
    return [" It", " happened"] + lead + [f" {rng.randint(1500, 2020)}", ",", " they", " said"], 2 + len(lead)


def _tion(rng):
    stem = rng.choice([" na", " sta", " crea", " rela", " mo", " ra", " posi", " condi", " direc"])
    return [" the", " new", stem, "tion", " of", " the", " zorb"], 3


def _thee(rng):
    tokens = rng.choice([[" I", " will", " bless", " thee"], [" and", " thou", " shalt"], [" unto", " thee"],
                         [" thy", " kingdom"], [" for", " thou", " art"], [" I", " say", " unto", " thee"]])
    index = next(i for i, t in enumerate(tokens) if t.strip() in ("thee", "thou", "thy"))
    return [" And", " he", " said", ","] + tokens + [" in", " glory"], 4 + index


def _url(rng):
    site, tld = rng.choice(["zorblat", "quuxfeed", "blorpnews", "frobwiki"]), rng.choice(["com", "org", "net"])
    tokens = [" see", " https", "://", "www", ".", site, ".", tld, "/", rng.choice(["about", "index", "p"])]
    return tokens, rng.choice([2, 3, 5, 7])


def _medical(rng):
    word = rng.choice([" patient", " hospital", " surgery", " fever", " diagnosis", " infection", " nurse",
                       " symptoms", " clinic", " doctor"])
    return [" The", " zorb", " was", " about", " the"] + [word] + [" and", " the", " treatment"], 5


def _places(rng):
    place = rng.choice([" Paris", " London", " Berlin", " Madrid", " Vienna", " Lisbon", " Prague", " Rome"])
    return [" Last", " year", " she", " travelled", " to"] + [place] + [" with", " friends"], 5


def _mixed(rng):
    word = rng.choice([" banana", " quickly", " 42", " Paris", " the", " river", " wrote", " green", " seven",
                       " software", " sang", " blorp", " cheap", " hospital", " yesterday", " ,"])
    filler = [rng.choice([" the", " of", " and", " said", " was", " with", " in", " they", " new", " to", " its",
                          " year", " she", " for"]) for _ in range(7)]  # words the other prototypes use too
    return filler[:5] + [word] + filler[5:], 5


def _finance(rng):
    word = rng.choice([" shares", " profit", " investment", " revenue", " stock", " prices", " dividend",
                       " market", " bank", " loan"])
    return [" The", " company", " said", " its"] + [word] + [" rose", " sharply"], 4


def _comma(rng):
    words = [rng.choice([" apples", " pears", " zorbs", " red", " big", " sang"]) for _ in range(4)]
    return words[:2] + [","] + words[2:], 2


PROTOTYPES = {0: _year, 1: _tion, 2: _thee, 3: _url, 4: _medical, 5: _places, 6: _mixed, 7: _finance, 8: _comma}
DEAD = 9  # in prototype_stats, never active: no evidence
EXPECTED = {0: "numbers/time", 1: "morphology", 2: "grammatical scaffolding", 3: "urls", 4: "medical/bio",
            5: "named entities", 7: "finance", 8: "grammatical scaffolding", DEAD: "misc"}


PREFIX = ["Made", "-up", " text", "."]  # every synthetic document starts with these tokens


def build_evidence_db(path: Path, seed: int = 0, prototypes: dict | None = None, dead: tuple[int, ...] = (DEAD,),
                      n_evidence: int = N_EVIDENCE) -> Path:
    """A fresh database holding made-up evidence for `prototypes` (id -> generator), as the evidence job leaves it.

    Like a byte-level BPE tokenizer's offsets, a token's characters leave its leading space out; context_tokens
    hold those characters (the evidence job stores text[start:end]); the documents hold the full text.
    """
    prototypes = PROTOTYPES if prototypes is None else prototypes
    rng = random.Random(seed)
    con = connect(path)
    start_job(con, "evidence", {"synthetic": True, "seed": seed})
    for pid, make in prototypes.items():
        follow = {}
        for rank in range(n_evidence):
            tokens, index = make(rng)
            doc_tokens = PREFIX + tokens
            doc_id = f"synthetic/{pid}-{rank}"
            text = "".join(doc_tokens)
            spans, cursor = [], 0
            for t in doc_tokens:
                lead = len(t) - len(t.lstrip())
                spans.append((cursor + lead, cursor + len(t)))
                cursor += len(t)
            ctx = spans[len(PREFIX):]
            position = len(PREFIX) + index
            acts = [round(rng.uniform(0.0, 0.3), 4) for _ in tokens]
            acts[index] = round(0.9 - 0.03 * rank, 4)
            nxt = 3000 + index + 1 if index + 1 < len(tokens) else None
            con.execute("INSERT INTO documents VALUES (?, 'local', NULL, NULL, ?, ?, ?, ?)",
                        [doc_id, text, hashlib.sha256(text.encode()).hexdigest(), len(text), len(doc_tokens)])
            con.execute("INSERT INTO evidence VALUES (?, ?, ?, ?, 0, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        [pid, rank, doc_id, position, len(doc_tokens), *spans[position], acts[index],
                         1000 + index, text[slice(*spans[position])], nxt, len(PREFIX),
                         [text[a:b] for a, b in ctx], acts, [a for a, _ in ctx], [b for _, b in ctx]])
            if index + 1 < len(tokens):
                follow[tokens[index + 1]] = follow.get(tokens[index + 1], 0) + 1
        ranked = sorted(follow.items(), key=lambda kv: (-kv[1], kv[0]))
        for rank, (token, count) in enumerate(ranked):
            con.execute("INSERT INTO next_tokens VALUES (?, ?, ?, ?, ?)", [pid, rank, 2000 + rank, token, count])
        for rank, (token, count) in enumerate(ranked[:3]):
            con.execute("INSERT INTO logit_signatures VALUES (?, ?, ?, ?, ?)",
                        [pid, rank, 2000 + rank, token, 3.0 - rank + 0.1 * count])
    for pid in [*prototypes, *dead]:
        active = pid in prototypes
        con.execute("INSERT INTO prototype_stats VALUES (?, ?, ?, ?, ?, ?)",
                    [pid, 40 if active else 0, 0.5 if active else None, 0.9 if active else None, [0.0, 0.5, 1.0],
                     [20, 20] if active else [0, 0]])
    finish_job(con, "evidence")
    con.close()
    return path


def _labelled(folder: Path, labeler=None) -> dict:
    path = build_evidence_db(folder / "db.duckdb")
    con = connect(path)
    written = labels_job.run(con, labeler, batch_size=4)
    rows = con.execute("SELECT * FROM labels ORDER BY prototype_id").fetchall()
    siblings = con.execute("SELECT * FROM label_siblings ORDER BY prototype_id, rank").fetchall()
    con.close()
    return {"path": path, "written": written, "rows": rows, "siblings": siblings}


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    """The synthetic database after one run of the default labeler (v3; batch_size 4, so several chunks)."""
    return _labelled(tmp_path_factory.mktemp("labels"))


@pytest.fixture(scope="module")
def labelled_v2(tmp_path_factory):
    """The same after one run of labeler v2 (offline-v2)."""
    from precompute.labels.contrast import ContrastiveLabeler

    return _labelled(tmp_path_factory.mktemp("labels-v2"), ContrastiveLabeler())


@pytest.fixture(scope="module")
def labelled_v1(tmp_path_factory):
    """The same after one run of the token-rule labeler (offline-v1)."""
    return _labelled(tmp_path_factory.mktemp("labels-v1"), OfflineLabeler())


def _table(path: Path) -> list[tuple]:
    con = connect(path, read_only=True)
    try:
        return con.execute("SELECT * FROM labels ORDER BY prototype_id").fetchall()
    finally:
        con.close()


# ----------------------------------------------------------------------------------------------------------------
# Rules and parsing (no model).


@pytest.mark.parametrize(("token", "context", "index", "category", "kind"), [
    (" 1843", [" in", " 1843", ","], 1, "numbers/time", "year"),
    ("4", [" in", " 18", "4", "3"], 2, "numbers/time", "year"),
    ("tion", [" na", "tion", " of"], 1, "morphology", "suffix"),
    (" thee", [" bless", " thee"], 1, "grammatical scaffolding", "archaic pronoun"),
    ("com", [" https", "://", "www", ".", "zorb", ".", "com"], 6, "urls", "url"),
    (",", [" red", ",", " blue"], 1, "grammatical scaffolding", "punctuation"),
    (" of", [" out", " of"], 1, "grammatical scaffolding", "preposition"),
    (" Paris", [" went", " to", " Paris"], 2, None, "proper noun"),
    (" The", [".", " The"], 1, "grammatical scaffolding", "determiner"),
    (" may", [" it", " may"], 1, "grammatical scaffolding", "auxiliary verb"),
    (" May", [" in", " May"], 1, "numbers/time", "month"),
    (" 5", [" $", " 5"], 1, "finance", "money"),
    (" banana", [" a", " banana"], 1, None, "content"),
])
def test_token_rules(token, context, index, category, kind):
    got = token_kind(token, context, index)
    assert (got.category, got.kind) == (category, kind)


def test_normalize_category_accepts_spellings_and_refuses_unknown():
    assert normalize_category("Medical & Bio") == "medical/bio"
    assert normalize_category("URLs") == "urls"
    assert normalize_category("numbers and time") == "numbers/time"
    assert normalize_category("Grammatical Scaffolding") == "grammatical scaffolding"
    assert normalize_category("miscellaneous") == "misc"
    assert normalize_category("cooking") is None
    assert all(normalize_category(c) == c for c in CATEGORIES)


def test_parse_reply_tolerates_fences_and_marks_unknown_categories():
    reply = 'Sure!\n```json\n{"category": "Numbers & Time", "label": "year numbers", "explanation": "years"}\n```'
    assert parse_reply(reply) == LabelResult("numbers/time", "year numbers", "years")
    odd = parse_reply('{"category": "cooking", "label": "recipes"} trailing words')
    assert odd.category == "misc" and "cooking" in odd.explanation and odd.label == "recipes"
    for bad in ("no json here", '{"category": "urls"}', '{"category": "urls", "label": ""}', "{broken"):
        with pytest.raises(ValueError):
            parse_reply(bad)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auroc_matches_sklearn_with_ties(seed):
    rng = np.random.default_rng(seed)
    pos = np.round(rng.normal(0.5, 1.0, 37), 1)  # rounding makes ties, within and across the classes
    neg = np.round(rng.normal(0.0, 1.0, 53), 1)
    expected = roc_auc_score(np.r_[np.ones(len(pos)), np.zeros(len(neg))], np.r_[pos, neg])
    assert auroc(pos, neg) == pytest.approx(expected, abs=1e-12)
    assert auroc(np.array([2.0, 3.0]), np.array([0.0, 1.0])) == 1.0
    assert auroc(np.array([0.0]), np.array([1.0])) == 0.0
    assert auroc(np.array([1.0, 1.0]), np.array([1.0])) == 0.5


def test_cards_gather_evidence_next_tokens_and_signature(tmp_path):
    path = build_evidence_db(tmp_path / "db.duckdb")
    con = connect(path, read_only=True)
    card, dead = load_cards(con, [0, DEAD])
    con.close()
    assert [e.rank for e in card.evidence] == list(range(N_EVIDENCE))
    assert all(e.context_tokens[e.token_index] == e.token for e in card.evidence)
    assert card.evidence[0].token.strip().isdigit() and "«" in card.evidence[0].marked()
    assert card.next_tokens[0] == (",", N_EVIDENCE) and card.logit_tokens[0][0] == ","
    assert sum(n for _, n in card.activating_tokens) == N_EVIDENCE
    train, held_out = card.split()
    assert [e.rank for e in train.evidence] == [0, 2, 4, 6, 8] and [e.rank for e in held_out] == [1, 3, 5, 7, 9]
    assert dead.evidence == [] and dead.activation_count == 0


def test_contexts_without_document_text(tmp_path):
    """Text-less databases: stored token strings get their spaces back from the offsets; a pointer-only row whose
    document the installed corpus cannot give is skipped (with a warning), not a crash."""
    path = build_evidence_db(tmp_path / "db.duckdb")
    con = connect(path, read_only=True)
    full = load_cards(con, [0, 1])
    con.close()
    con = connect(path)
    con.execute("UPDATE documents SET text = NULL")
    tokens_only = load_cards(con, [0, 1])
    con.execute("UPDATE evidence SET token = '', context_tokens = []")  # what strip-text leaves
    pointer_only = load_cards(con, [0, 1])
    con.close()
    for a, b in zip(full, tokens_only, strict=True):
        assert [e.window() for e in a.evidence] == [e.window() for e in b.evidence]
        assert [e.token for e in a.evidence] == [e.token for e in b.evidence]
    assert full[0].evidence[0].token.startswith(" ") and full[1].evidence[0].token == "tion"
    assert all(card.evidence == [] for card in pointer_only)


# ----------------------------------------------------------------------------------------------------------------
# The offline labeler and the job.


def test_offline_labels_are_valid_and_sensible(labelled_v1):
    labelled = labelled_v1
    rows = {r[0]: r for r in labelled["rows"]}
    assert labelled["written"] == len(rows) == len(PROTOTYPES) + 1
    for _pid, category, label, score, labeler, explanation, sibling_score, *v3 in labelled["rows"]:
        assert v3[:3] == [None, None, None]  # v1 names neither side nor a topic; every labeler gets detection scores
        assert all(d is None or 0.0 <= d <= 1.0 for d in v3[3:])
        assert category in CATEGORIES
        assert label and len(label) <= labels_job.MAX_LABEL_CHARS and labeler == OfflineLabeler.name
        assert explanation
        assert score is None or 0.0 <= score <= 1.0
        assert sibling_score is None or 0.0 <= sibling_score <= 1.0  # every labeler's rows get both scores
    for pid, category in EXPECTED.items():
        assert rows[pid][1] == category, (pid, rows[pid])
    assert "year" in rows[0][2]
    assert "-tion" in rows[1][2]
    assert "archaic 2nd-person pronoun" in rows[2][2]
    assert rows[DEAD][3] is None  # no held-out evidence, no score


def _slot(words, lead_word):
    """A prototype on one function word whose next token is one of `words`: a slot (offline.SLOT_SHARE)."""
    def make(rng):
        lead = rng.choice([[" she", " went", " to"], [" they", " called"], [" he", " saw"], [" we", " asked", " about"],
                           [" it", " was", " near"]])
        return [" Later", ","] + lead + [lead_word, rng.choice(words), " again", "."], 2 + len(lead)
    return make


SLOTS = {  # id -> (generator, expected category)
    20: (_slot([" patient", " hospital", " surgery", " fever", " diagnosis", " infection", " nurse", " symptoms",
                " clinic", " doctor"], " the"), "medical/bio"),
    21: (_slot([" 1843", " 1901", " 1776", " 1999", " 1850", " 1920", " 2004", " 1588"], " in"), "numbers/time"),
    22: (_slot([" banana", " quickly", " river", " wrote", " green", " software", " sang", " cheap", " blorp",
                " purple"], " the"), "grammatical scaffolding"),  # predicts content words of no one field
}


def test_function_word_prototypes_take_the_category_of_what_they_predict(tmp_path):
    """A prototype on 'the' before medical words is medical/bio, on 'in' before years numbers/time (slots); 'the'
    before words of no one field, and the rule-labelled prototypes of the main fixture, keep their categories."""
    prototypes = {**PROTOTYPES, **{pid: make for pid, (make, _) in SLOTS.items()}}
    path = build_evidence_db(tmp_path / "db.duckdb", prototypes=prototypes)
    con = connect(path)
    labels_job.run(con, OfflineLabeler(), batch_size=8)
    rows = {r[0]: r for r in con.execute("SELECT prototype_id, category, label, explanation FROM labels").fetchall()}
    con.close()
    for pid, (_, category) in SLOTS.items():
        assert rows[pid][1] == category, rows[pid]
    for pid, category in EXPECTED.items():
        assert rows[pid][1] == category, (pid, rows[pid])
    assert rows[20][2].endswith("after 'the'") and "slot: predicts content words 100%" in rows[20][3]
    assert rows[21][2].endswith("after 'in'") and any(ch.isdigit() for ch in rows[21][2])
    assert "slot" not in rows[22][3] and "determiner 'the'" in rows[22][2]


def test_v2_labels_are_valid_distinct_and_keep_v1_categories(labelled_v2, labelled_v1):
    labelled = labelled_v2
    v1 = {r[0]: r for r in labelled_v1["rows"]}
    for pid, category, label, score, labeler, explanation, *_ in labelled["rows"]:
        assert labeler == "offline-v2" and category == v1[pid][1] and explanation
        assert label and len(label) <= labels_job.MAX_LABEL_CHARS and "mixed" not in label
        assert score is None or score > 0.5
    assert len({r[2] for r in labelled["rows"]}) == len(labelled["rows"])


def test_label_score_prefers_coherent_prototypes(labelled_v1):
    scores = {r[0]: r[3] for r in labelled_v1["rows"]}
    for coherent in (0, 1, 2, 4, 5, 7):  # 6 is the random mix
        assert scores[coherent] > scores[6] + 0.1, scores
        assert scores[coherent] > 0.85, scores
    assert scores[3] > 0.6, scores  # made-up site names embed poorly, but the URL label still beats chance


def test_rerun_is_idempotent_and_other_arguments_are_refused(labelled, tmp_path):
    path = tmp_path / "db.duckdb"
    path.write_bytes(labelled["path"].read_bytes())
    con = connect(path)
    assert labels_job.run(con, batch_size=4) == 0  # done with the same arguments: nothing to do
    with pytest.raises(JobArgsMismatch, match="seed"):
        labels_job.run(con, seed=1)
    assert con.execute("SELECT count(*) FROM labels").fetchone()[0] == len(labelled["rows"])
    assert labels_job.run(con, seed=1, overwrite=True) == len(labelled["rows"])
    con.close()


def test_job_needs_finished_evidence(tmp_path):
    con = connect(tmp_path / "empty.duckdb")
    with pytest.raises(RuntimeError, match="evidence"):
        labels_job.run(con)
    con.close()


def _run_until_killed(db: Path, n_chunks: int) -> str:
    """Start the labels CLI (one prototype per chunk, each transaction held open 1 s), SIGKILL it once it has
    committed n_chunks chunks, i.e. while it sits inside the next chunk's transaction with rows written."""
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "precompute.labels", "--db", str(db), "--batch-size", "1",
                             "--hook", "hold-chunk-s=1"],
                            cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    log, watchdog = [], threading.Timer(300, proc.kill)  # a hung job fails the test instead of hanging it
    watchdog.start()
    try:
        for line in proc.stderr:
            log.append(line)
            committed = sum("committed prototypes" in x for x in log)
            if committed >= n_chunks and "holding the chunk" in line:
                time.sleep(0.5)  # the next chunk's rows are written; its transaction is still open
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "".join(log)
    return "".join(log)


@pytest.mark.slow
def test_sigkill_mid_chunk_then_resume_equals_an_uninterrupted_run(labelled, tmp_path):
    db = build_evidence_db(tmp_path / "killed.duckdb")
    log = _run_until_killed(db, n_chunks=3)
    assert "committed prototypes 2-2" in log and "committed prototypes 3-3" not in log
    con = connect(db)
    assert con.execute("SELECT count(*) FROM labels").fetchone()[0] == 3  # the open chunk left nothing
    assert con.execute("SELECT status FROM runs WHERE job = 'labels'").fetchone()[0] == "running"
    written = labels_job.run(con, batch_size=1)  # resumes: same arguments, unfinished
    con.close()
    assert written == len(labelled["rows"]) - 3
    assert _table(db) == labelled["rows"]  # the default labeler (v3): labels, its parts, every score
    con = connect(db, read_only=True)
    assert con.execute("SELECT * FROM label_siblings ORDER BY prototype_id, rank").fetchall() == labelled["siblings"]
    con.close()


# ----------------------------------------------------------------------------------------------------------------
# LLM labelers against a fake OpenAI-compatible server, and a local model folder.


class _FakeChat(BaseHTTPRequestHandler):
    replies: list = []  # each: (status, content or None for a malformed body)
    requests: list = []

    def do_POST(self):  # noqa: N802 - the http.server interface
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
        status, content = type(self).replies.pop(0) if type(self).replies else (200, None)
        if content is None:
            payload = b"this is not json"
        else:
            payload = json.dumps({"id": "x", "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    _FakeChat.replies, _FakeChat.requests = [], []
    server = HTTPServer(("127.0.0.1", 0), _FakeChat)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", _FakeChat
    server.shutdown()
    server.server_close()


def _card(tmp_path, pid=0):
    path = build_evidence_db(tmp_path / "db.duckdb")
    con = connect(path, read_only=True)
    card = load_cards(con, [pid])[0]
    con.close()
    return path, card


def test_openai_labeler_prompt_parsing_and_retry(fake_server, tmp_path):
    url, handler = fake_server
    _, card = _card(tmp_path)
    handler.replies = [
        (200, "I think it is about years."),  # malformed: no JSON, retried
        (200, '```json\n{"category": "Numbers & Time", "label": "year numbers", "explanation": "4-digit years"}\n```'),
        (200, '{"category": "astrology", "label": "star signs", "explanation": "?"}'),
    ]
    labeler = OpenAICompatibleLabeler(url, "fake-model", api_key="k-123", timeout=5)
    assert labeler.label(card) == LabelResult("numbers/time", "year numbers", "4-digit years")
    request = handler.requests[0]
    assert request["path"] == "/v1/chat/completions" and request["auth"] == "Bearer k-123"
    assert request["body"]["model"] == "fake-model"
    prompt = request["body"]["messages"][-1]["content"]
    assert "«" in prompt and "1" in prompt and all(c in prompt for c in CATEGORIES)
    odd = labeler.label(card)
    assert odd.category == "misc" and "astrology" in odd.explanation and len(handler.requests) == 3


def test_openai_labeler_http_failure_is_a_clear_error(fake_server, tmp_path):
    url, handler = fake_server
    _, card = _card(tmp_path)
    handler.replies = [(500, "boom"), (503, "still down")]
    with pytest.raises(LabelerError, match="HTTP 503"):
        OpenAICompatibleLabeler(url, "fake-model", timeout=5).label(card)
    handler.replies = [(200, None), (200, None)]  # a body that is not JSON, twice
    with pytest.raises(LabelerError, match="did not answer JSON"):
        OpenAICompatibleLabeler(url, "fake-model", timeout=5).label(card)
    with pytest.raises(LabelerError, match="cannot reach"):
        OpenAICompatibleLabeler("http://127.0.0.1:9/v1", "m", timeout=2).label(card)
    with pytest.raises(ValueError, match="http"):
        OpenAICompatibleLabeler("ftp://x", "m")


def test_labels_job_with_the_openai_labeler_via_cli(fake_server, tmp_path, capsys):
    url, handler = fake_server
    path = build_evidence_db(tmp_path / "db.duckdb", prototypes={0: _year, 3: _url}, dead=())
    handler.replies = [
        (200, '{"category": "numbers/time", "label": "year numbers", "explanation": "years"}'),
        (200, '{"category": "URLs", "label": "web address pieces", "explanation": "links"}'),
    ]
    labels_main(["--db", str(path), "--labeler", "openai", "--endpoint", url, "--llm-model", "fake-model"])
    rows = _table(path)
    assert [(r[0], r[1], r[2]) for r in rows] == [(0, "numbers/time", "year numbers"),
                                                  (3, "urls", "web address pieces")]
    assert rows[0][4] == f"openai:fake-model@{url}" and all(0.0 <= r[3] <= 1.0 for r in rows)
    assert "2 prototypes labelled" in capsys.readouterr().out


def test_local_labeler_loads_a_local_folder_only(tmp_path, monkeypatch):
    from helpers import tiny_backbone_dir

    with pytest.raises(FileNotFoundError, match="never downloads"):
        LocalInstructLabeler(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError):
        LocalInstructLabeler("HuggingFaceTB/SmolLM2-135M-Instruct")  # a hub id is not a folder
    folder = tiny_backbone_dir(tmp_path / "tiny")
    labeler = LocalInstructLabeler(folder, max_new_tokens=8)
    _, card = _card(tmp_path)
    reply = labeler._complete(labels_job.build_prompt(card))  # a random tiny model: real generation, any text
    assert isinstance(reply, str)
    labeler.tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                       "{% if add_generation_prompt %}assistant:{% endif %}")
    assert isinstance(labeler._complete("a short prompt"), str)  # the chat-template path
    with pytest.raises(LabelerError, match="failed twice"):
        labeler.label(card)  # random text is no JSON: retried once, then a clear error
    answers = iter(['{"category": "science/tech", "label": "chemistry terms", "explanation": "e"}'])
    monkeypatch.setattr(labeler, "_complete", lambda prompt: next(answers))
    assert labeler.label(card) == LabelResult("science/tech", "chemistry terms", "e")


def test_cli_help_and_argument_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        labels_main(["--help"])
    assert exit_info.value.code == 0 and "--labeler" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        labels_main(["--db", str(tmp_path / "x.duckdb"), "--labeler", "openai"])
    assert exit_info.value.code == 2 and "--endpoint" in capsys.readouterr().err
