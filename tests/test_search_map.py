"""The search job and queries (semantic search in DuckDB, literal label search, read-only connections) and the
map job (UMAP / PCA layouts, determinism, fallback, command line), on the synthetic evidence of test_labels.py."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import tiny_prism
from sklearn.decomposition import PCA
from test_labels import build_evidence_db

from precompute import labels as labels_job
from precompute import map as map_job
from precompute import search as search_job
from precompute.embed import EMBED_DIM, embed
from precompute.runs import JobArgsMismatch, connect
from precompute.search import label_search, semantic_search


@pytest.fixture(scope="module")
def searchable(tmp_path_factory):
    """The synthetic database with labels and search embeddings (batch_size 3: several chunks)."""
    path = build_evidence_db(tmp_path_factory.mktemp("search") / "db.duckdb")
    con = connect(path)
    labels_job.run(con, batch_size=5)
    written = search_job.run(con, batch_size=3)
    rows = con.execute("SELECT * FROM embeddings ORDER BY kind, prototype_id, item").fetchall()
    con.close()
    return {"path": path, "written": written, "rows": rows}


def _copy(src, tmp_path):
    dst = tmp_path / "copy.duckdb"
    dst.write_bytes(src.read_bytes())
    return dst


def test_embeddings_table(searchable):
    rows = searchable["rows"]
    con = connect(searchable["path"], read_only=True)
    try:  # a prediction's vector is the embedded list of the tokens its signature raises
        tokens = [t for t, v in con.execute("SELECT token, value FROM logit_signatures WHERE prototype_id = 0 "
                                            "ORDER BY rank").fetchall() if v > 0]
        topics = con.execute("SELECT count(*) FROM labels WHERE topic IS NOT NULL").fetchone()[0]
    finally:
        con.close()
    # a label per prototype, a topic where it has one, a prediction and 10 evidence rows per live one
    assert searchable["written"] == len(rows) == 10 + topics + 9 + 9 * 10
    kinds = {kind for kind, *_ in rows}
    assert kinds == {"label", "predicts", "evidence"} | ({"topic"} if topics else set())
    assert {item for kind, _, item, _ in rows if kind != "evidence"} == {0}
    stored = next(v for kind, pid, _, v in rows if kind == "predicts" and pid == 0)
    np.testing.assert_allclose(stored, embed([search_job.predicts_text(tokens)], progress=False)[0], atol=1e-5)
    assert sorted(item for kind, pid, item, _ in rows if kind == "evidence" and pid == 0) == list(range(10))
    vectors = np.array([v for *_, v in rows], dtype=np.float32)
    assert vectors.shape == (len(rows), EMBED_DIM)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize(("query", "kind", "expected"), [
    ("years and dates", "label", 0),
    ("web addresses and links", "label", 3),
    ("patients in a hospital", "label", 4),
    ("capital cities of Europe", "label", 5),
    ("the hospital treated her infection", "evidence", 4),
    ("she travelled to Vienna", "evidence", 5),
    ("the company's shares and profits", "evidence", 7),
])
def test_semantic_search_ranks_the_matching_prototype_first(searchable, query, kind, expected):
    con = connect(searchable["path"], read_only=True)  # the app's connection
    try:
        results = semantic_search(con, query, k=5, kind=kind)
    finally:
        con.close()
    assert results[0]["prototype_id"] == expected, results
    assert len(results) == 5 and len({r["prototype_id"] for r in results}) == 5
    scores = [r["score"] for r in results]
    assert scores == sorted(scores, reverse=True) and all(-1.0 <= s <= 1.0 for s in scores)
    assert set(results[0]) == {"prototype_id", "score", "label", "category", "item", "kind"}


def test_semantic_search_scores_equal_numpy_cosines(searchable):
    from precompute.embed import embed

    con = connect(searchable["path"], read_only=True)
    try:
        results = semantic_search(con, "a year in the nineteenth century", k=3, kind="evidence")
        stored = con.execute("SELECT prototype_id, item, vector FROM embeddings WHERE kind = 'evidence'").fetchall()
    finally:
        con.close()
    query = embed(["a year in the nineteenth century"])[0]
    best: dict[int, tuple[float, int]] = {}
    for pid, item, vector in stored:
        score = float(np.asarray(vector, dtype=np.float32) @ query)
        if pid not in best or score > best[pid][0]:
            best[pid] = (score, item)
    expected = sorted(best.items(), key=lambda kv: -kv[1][0])[:3]
    assert [r["prototype_id"] for r in results] == [pid for pid, _ in expected]
    for r, (_, (score, item)) in zip(results, expected, strict=True):
        assert r["score"] == pytest.approx(score, abs=1e-5) and r["item"] == item


def test_label_search_is_literal_and_case_insensitive(searchable, tmp_path):
    path = _copy(searchable["path"], tmp_path)
    con = connect(path)
    con.execute("UPDATE labels SET label = '100% sure_thing' WHERE prototype_id = 6")
    con.close()
    con = connect(path, read_only=True)
    try:
        years = label_search(con, "YEAR")
        assert years and years[0]["prototype_id"] == 0
        assert {r["prototype_id"] for r in label_search(con, "urls")} == {3}  # the category matches too
        assert [r["prototype_id"] for r in label_search(con, "%")] == [6]  # a literal %, not a wildcard
        assert [r["prototype_id"] for r in label_search(con, "_")] == [6]
        for evil in ("'; DROP TABLE labels; --", "\" OR 1=1 --", "') OR ('a'='a", "%' OR '1'='1"):
            assert label_search(con, evil) == []
            assert isinstance(semantic_search(con, evil, k=3), list)
        assert con.execute("SELECT count(*) FROM labels").fetchone()[0] == 10
        assert len(label_search(con, "", k=4)) == 4
        with pytest.raises(ValueError, match="kind"):
            semantic_search(con, "x", kind="labels; DROP TABLE labels")
        with pytest.raises(ValueError, match="k must be"):
            label_search(con, "x", k=0)
    finally:
        con.close()


def test_search_job_resumes_after_a_failure_with_identical_rows(searchable, tmp_path, monkeypatch):
    path = build_evidence_db(tmp_path / "db.duckdb")
    con = connect(path)
    labels_job.run(con, batch_size=5)
    real_embed, calls = search_job.embed, []

    def failing_embed(texts, *args, **kwargs):
        calls.append(len(texts))
        if len(calls) == 3:
            raise RuntimeError("simulated crash in the third chunk")
        return real_embed(texts, *args, **kwargs)

    monkeypatch.setattr(search_job, "embed", failing_embed)
    with pytest.raises(RuntimeError, match="simulated"):
        search_job.run(con, batch_size=3)
    assert con.execute("SELECT count(DISTINCT prototype_id) FROM embeddings").fetchone()[0] == 6
    monkeypatch.setattr(search_job, "embed", real_embed)
    search_job.run(con, batch_size=3)
    rows = con.execute("SELECT * FROM embeddings ORDER BY kind, prototype_id, item").fetchall()
    assert search_job.run(con, batch_size=3) == 0  # done
    con.close()
    assert rows == searchable["rows"]


def test_search_job_order_and_arguments(searchable, tmp_path):
    con = connect(tmp_path / "fresh.duckdb")
    with pytest.raises(RuntimeError, match="labels"):
        search_job.run(con)
    con.close()
    con = connect(_copy(searchable["path"], tmp_path))
    labels_job.run(con, seed=3, overwrite=True)  # new labels: the stored embeddings are stale
    with pytest.raises(JobArgsMismatch, match="labels_run"):
        search_job.run(con)
    assert search_job.run(con, overwrite=True) == len(searchable["rows"])
    con.close()


def test_embed_cli_help(capsys):
    from precompute.embed import main as embed_main

    with pytest.raises(SystemExit) as exit_info:
        embed_main(["--help"])
    assert exit_info.value.code == 0 and "texts" in capsys.readouterr().out


def test_search_cli(searchable, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        search_job.main(["--help"])
    assert exit_info.value.code == 0 and "--query" in capsys.readouterr().out
    results = search_job.main(["--db", str(searchable["path"]), "--query", "web links", "-k", "2"])
    assert results[0]["prototype_id"] == 3 and "urls" in capsys.readouterr().out
    results = search_job.main(["--db", str(searchable["path"]), "--label", "suffix"])
    assert [r["prototype_id"] for r in results] == [1]
    path = _copy(searchable["path"], tmp_path)
    assert search_job.main(["--db", str(path)]) == 0  # done already
    with pytest.raises(SystemExit):
        search_job.main(["--db", str(tmp_path / "missing.duckdb"), "--query", "x"])


# ----------------------------------------------------------------------------------------------------------------
# The map.


def _bank(k: int, d: int = 32, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(4, d))
    return (centres[np.arange(k) % 4] + 0.3 * rng.normal(size=(k, d))).astype(np.float32)  # (k, d), 4 clusters


def _map_rows(path) -> list[tuple]:
    con = connect(path, read_only=True)
    try:
        return con.execute("SELECT * FROM prototype_map ORDER BY prototype_id").fetchall()
    finally:
        con.close()


def test_umap_map_is_deterministic_for_a_seed(tmp_path):
    vectors = _bank(40)
    for name in ("a", "b"):
        con = connect(tmp_path / f"{name}.duckdb")
        assert map_job.run(con, vectors, seed=7) == 40
        con.close()
    rows = _map_rows(tmp_path / "a.duckdb")
    assert rows == _map_rows(tmp_path / "b.duckdb")
    assert [r[0] for r in rows] == list(range(40)) and {r[3] for r in rows} == {"umap"}
    coords = np.array([(r[1], r[2]) for r in rows])
    assert np.isfinite(coords).all() and coords.std(axis=0).min() > 0
    # the four clusters of directions stay apart: each point's nearest neighbour is in its own cluster
    dist = np.linalg.norm(coords[:, None] - coords[None], axis=-1) + np.eye(40) * 1e9
    assert (dist.argmin(axis=1) % 4 == np.arange(40) % 4).mean() >= 0.9


def test_pca_fallback_and_independent_pca(tmp_path):
    vectors = _bank(8)
    con = connect(tmp_path / "db.duckdb")
    assert map_job.run(con, vectors, method="umap") == 8  # too few for UMAP: PCA, recorded as such
    rows = con.execute("SELECT x, y, method FROM prototype_map ORDER BY prototype_id").fetchall()
    assert {r[2] for r in rows} == {"pca"}
    normalised = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    expected = PCA(n_components=2).fit_transform(normalised.astype(np.float64))
    got = np.array([(r[0], r[1]) for r in rows])
    np.testing.assert_allclose(np.abs(got), np.abs(expected), atol=1e-6)  # equal up to each component's sign
    assert map_job.run(con, vectors, method="umap") == 0  # done
    with pytest.raises(JobArgsMismatch, match="seed"):
        map_job.run(con, vectors, seed=1)
    with pytest.raises(JobArgsMismatch, match="vectors_sha256"):
        map_job.run(con, vectors * 2)  # another bank (another model)
    assert map_job.run(con, _bank(20), method="pca", overwrite=True) == 20
    assert con.execute("SELECT count(*), min(method) FROM prototype_map").fetchone() == (20, "pca")
    con.close()
    coords, used = map_job.layout(_bank(1), "umap")
    assert used == "pca" and coords.shape == (1, 2) and not coords.any()
    with pytest.raises(ValueError, match="method"):
        map_job.layout(vectors, "tsne")
    with pytest.raises(ValueError, match="NaN"):
        map_job.layout(np.full((4, 3), np.nan), "pca")


def test_map_cli_on_a_saved_model(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        map_job.main(["--help"])
    assert exit_info.value.code == 0 and "--method" in capsys.readouterr().out
    model = tiny_prism(n_prototypes=12)
    model.save_pretrained(tmp_path / "model")
    db = tmp_path / "db.duckdb"
    assert map_job.main(["--db", str(db), "--model", str(tmp_path / "model"), "--method", "pca"]) == 12
    assert "wrote 12 rows (pca)" in capsys.readouterr().out
    rows = _map_rows(db)
    expected = map_job.pca_2d(model.prototypes.weight.detach().float().numpy())
    np.testing.assert_allclose(np.array([(r[1], r[2]) for r in rows]), expected, atol=1e-9)
    with pytest.raises(SystemExit) as exit_info:
        map_job.main(["--db", str(db), "--model", str(tmp_path / "model"), "--seed", "3"])
    assert exit_info.value.code == 2 and "--overwrite" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        map_job.main(["--db", str(db), "--model", str(tmp_path / "no-model")])
