"""The precompute database as the app holds it: one read-only connection shared by every user (external file
access off and locked, precompute/runs.py), a cursor per call (DuckDB connections are not thread-safe), and what
every page needs read once: labels, categories, whether search embeddings exist, and the check that the shipped
pointer-only evidence can be read back from the installed corpus packages.

    db = Database("assets/prism-default.duckdb")
    rows = db.run(query.evidence, 42, limit=6)        # any precompute.query function, on its own cursor
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from precompute import query

logger = logging.getLogger(__name__)

UNLABELLED = "unlabelled"


class Database:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._con = query.open_db(self.path)  # FileNotFoundError / ValueError with a clear message
        self._lock = threading.Lock()
        self.labels: dict[int, tuple[str, str]] = {
            int(r["prototype_id"]): (r["label"] or "", r["category"] or UNLABELLED)
            for r in self.run(query.prototype_table)}
        self.categories = [r["category"] for r in self.run(query.categories)]
        self.has_embeddings = self.run(lambda c: c.execute("SELECT count(*) FROM embeddings").fetchone()[0]) > 0
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
