"""The precompute database as the app holds it: one read-only connection shared by every user (external file
access off and locked, precompute/runs.py), a cursor per call (DuckDB connections are not thread-safe), what every
page needs read once (labels, categories, whether search embeddings exist, the check that the shipped pointer-only
evidence can be read back from the installed corpus packages), and what the pages ask of it: cards, search, the
prototype table, presets, map points. Every read goes through precompute/query.py (and precompute/search.py for
search); there is no SQL here. Problems the user can cause come back as AppError with a short message.

    db = Database("assets/prism-default.duckdb")
    card = db.card(42)                                 # precompute.query.PrototypeCard
    rows = db.search("year", mode="semantic")          # [{prototype_id, label, category, score, matched}]
    db.run(query.evidence, 42, limit=6)                # any precompute.query function, on its own cursor
"""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path

from app import limits
from app.errors import AppError
from precompute import query
from precompute.query import PrototypeCard, UnknownPrototype

logger = logging.getLogger(__name__)

UNLABELLED = "unlabelled"
NEVER_ACTIVE = "never active"  # a browser filter: prototypes with no activation in the corpus (dead)
MAX_QUERY_CHARS = 200


def check_prototype(prototype_id, n_prototypes: int) -> int:
    """A prototype id as typed or sent (int, float, string) if this bank has it; AppError otherwise."""
    if isinstance(prototype_id, str):
        prototype_id = prototype_id.strip()
        if not prototype_id.lstrip("-").isdigit():
            raise AppError(f"a prototype id is a whole number, got {limits.shown(prototype_id)}")
    x = limits.number("a prototype id", prototype_id, -math.inf, math.inf)
    if x != int(x):
        raise AppError(f"a prototype id is a whole number, got {x:g}")
    if not 0 <= x < n_prototypes:
        raise AppError(f"no prototype {x:.0f}: this model has prototypes 0..{n_prototypes - 1}")
    return int(x)


def clean_query(text: str) -> str:
    """A search string as the database sees it: printable characters only, at most MAX_QUERY_CHARS."""
    text = "".join(ch for ch in limits.text("the search", text, 100_000) if ch.isprintable()).strip()
    if not text:
        raise AppError("type something to search for")
    return text[:MAX_QUERY_CHARS]


class Database:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._con = query.open_db(self.path)  # FileNotFoundError / ValueError with a clear message
        self._lock = threading.Lock()
        self.labels: dict[int, tuple[str, str]] = {
            int(r["prototype_id"]): (r["label"] or "", r["category"] or UNLABELLED)
            for r in self.run(query.prototype_table)}
        self.n_prototypes = len(self.labels)
        self.categories = [r["category"] for r in self.run(query.categories)]
        self.has_embeddings = self.run(query.has_embeddings)
        self._presets = self.run(query.preset_counts)
        self._map_points: list[dict] | None = None
        # Pointer-only databases (the shipped one) hold no corpus text: read it back now and check the hashes.
        self.text_check = self.run(query.check_documents)
        if self.text_check["errors"]:
            logger.warning("%d of %d documents could not be read back from the installed corpus: %s",
                           self.text_check["documents"] - self.text_check["resolved"],
                           self.text_check["documents"], self.text_check["errors"][0])

    def run(self, fn, *args, **kwargs):
        with self._lock:
            cursor = self._con.cursor()
        try:
            return fn(cursor, *args, **kwargs)
        finally:
            cursor.close()

    def close(self) -> None:
        self._con.close()

    # -- what the pages read ----------------------------------------------------------------------------------

    def card(self, prototype_id, n_evidence: int = 6, n_band: int = 0) -> PrototypeCard:
        """A prototype card (label, scores, stats, histogram, signature, co-active, siblings), its top evidence and
        n_band contexts from the middle and the low end of its activation range."""
        pid = check_prototype(prototype_id, self.n_prototypes)
        try:
            return self.run(query.card, pid, n_evidence=n_evidence, n_band=n_band)
        except UnknownPrototype as err:
            raise AppError(str(err)) from None

    def search(self, text: str, mode: str = "label", k: int = 50) -> list[dict]:
        """Label (substring) or semantic search (labels, predictions and whatever evidence embeddings the database
        holds; the best match of each prototype, nearest first, none left out); rows {prototype_id, label,
        category, score} and, for semantic search, matched (the kind of the best match)."""
        needle = clean_query(text)
        from precompute.search import label_search, semantic_search

        if mode == "label":
            rows = self.run(label_search, needle, k=k)
            return [{"prototype_id": r["prototype_id"], "label": r["label"], "category": r["category"],
                     "score": r["label_score"]} for r in rows]
        if mode == "semantic":
            if not self.has_embeddings:
                raise AppError("this database has no search embeddings: run `python -m precompute.search --db DB`")
            rows = self.run(semantic_search, needle, k=k, kind="all")
            return [{"prototype_id": r["prototype_id"], "label": r["label"], "category": r["category"],
                     "score": r["score"], "matched": r["kind"]} for r in rows]
        raise AppError(f"search mode must be 'label' or 'semantic', got {limits.shown(mode)}")

    def filters(self) -> list[str]:
        """What the browser's category filter offers: the database's categories, then 'unlabelled' (no label) and
        'never active' (no activation in the corpus) whether or not any prototype is in them."""
        return filters(self)

    def table(self, category: str | None = None, order_by: str = "activation_count") -> list[dict]:
        """Every prototype of the database (or of one category / filter), sorted."""
        if category and category not in self.filters():
            raise AppError(f"unknown category {limits.shown(category)}: pick one from the list")
        if order_by not in query.ORDERINGS:
            raise AppError(f"sort by one of {', '.join(query.ORDERINGS)}, got {limits.shown(order_by)}")
        if category in (UNLABELLED, NEVER_ACTIVE):
            rows = self.run(query.prototype_table, order_by=order_by)
            if category == UNLABELLED:
                return [r for r in rows if not r["label"] or r["category"] in (None, UNLABELLED)]
            return [r for r in rows if not r["activation_count"]]
        return self.run(query.prototype_table, category=category or None, order_by=order_by)

    def category_ids(self, category: str) -> list[int]:
        ids = [p for p, (_, c) in self.labels.items() if c == category]
        if not ids:
            raise AppError(f"no prototype has category {limits.shown(category)}")
        return sorted(ids)

    def presets(self) -> list[dict]:
        """The database's intervention presets that hold prototypes: [{name, title, description, n}]."""
        from precompute.presets import PRESETS

        return [{"name": name, "title": spec.title, "description": spec.description, "n": self._presets[name]}
                for name, spec in PRESETS.items() if self._presets.get(name)]

    def preset_ids(self, name: str) -> tuple[str, list[int]]:
        """(title, prototype ids) of a preset, by name or title."""
        for preset in self.presets():
            if str(name) in (preset["name"], preset["title"]):
                return preset["title"], self.run(query.preset_ids, preset["name"])
        known = ", ".join(p["name"] for p in self.presets()) or "none in this database"
        raise AppError(f"no preset {limits.shown(name)}; presets: {known}")

    def map_points(self) -> list[dict]:
        """The map's points, read once: the database is read-only and the map follows every search and card."""
        if self._map_points is None:
            self._map_points = self.run(query.map_points)
        return self._map_points


def filters(db: Database | None) -> list[str]:
    """The category filter's choices, with or without a database."""
    categories = db.categories if db is not None else []
    return [*categories, *(f for f in (UNLABELLED, NEVER_ACTIVE) if f not in categories)]
