"""Exports: what a user takes away from the studio, as files the download buttons and the API endpoints return.

    generation_json(studio, session)   both texts, every token with its full decomposition and the alternatives
    interventions file                 app/share.py interventions_json (importable back)
    table_frame(studio)                every prototype with label, category, scores and activation stats
    evidence_frame(studio, 42)         one prototype's evidence: rank, source, activation, token and context

write_json / write_csv put each into a fresh folder inside one folder of this process under the system temp dir
(Gradio copies it into its own cache to serve it), with a name that says what it is. Each export first deletes the
folders older than the app's file_max_age_s, so a long-running app keeps at most that much history.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import pandas as pd

from app.core import AppError, Generation, Studio, side_by_side
from app.session import Session
from app.share import fingerprint, interventions_data, interventions_json

MAX_EVIDENCE = 1000


def generation_json(studio: Studio, session: Session) -> dict:
    """The session's texts (original and, when there is one, intervened) with every token's decomposition."""
    if session.original is None and session.intervened is None:
        raise AppError("generate first: there is no text to export")
    runs = {}
    for name, gen in (("original", session.original), ("intervened", session.intervened)):
        if gen is not None:
            runs[name] = _run(studio, gen)
    diff = side_by_side(session.original, session.intervened) if session.original and session.intervened else None
    gen = session.original or session.intervened
    s = gen.settings
    return {"format": "prism-generation/1", "model": fingerprint(studio),
            "settings": {"prompt": s.prompt, "max_new_tokens": s.max_new_tokens, "temperature": s.temperature,
                         "top_p": s.top_p, "seed": s.seed},
            "interventions": interventions_data(session),
            "first_change": diff.first_change if diff else None, "status": diff.status if diff else None,
            "runs": runs}


def _run(studio: Studio, gen: Generation) -> dict:
    tokens = []
    for i in range(len(gen.steps)):
        view = studio.token_view(gen, i)
        tokens.append({**view.as_dict(), "text": gen.steps[i].text})
    return {"prompt": gen.prompt_text, "text": gen.text, "finished": gen.finished, "notes": list(gen.notes),
            "tokens": tokens}


def table_frame(studio: Studio) -> pd.DataFrame:
    """Every prototype of the database, in id order, with the columns the database has."""
    rows = studio.need_db().table(order_by="prototype_id")
    return pd.DataFrame(rows)


def evidence_frame(studio: Studio, prototype_id) -> pd.DataFrame:
    """A prototype's evidence rows (at most MAX_EVIDENCE) with the context as plain text, the token in [brackets]."""
    card = studio.need_db().card(prototype_id, n_evidence=MAX_EVIDENCE)
    rows = []
    for e in card.evidence:
        context = "".join(f"[{s['text']}]" if s["target"] else s["text"] for s in e["segments"])
        rows.append({"prototype_id": card.prototype_id, "rank": e["rank"], "activation": e["activation"],
                     "token": e["token"], "context": context, "doc_id": e["doc_id"], "source": e["source"],
                     "title": e["title"], "url": e["url"], "error": e["error"]})
    return pd.DataFrame(rows, columns=["prototype_id", "rank", "activation", "token", "context", "doc_id", "source",
                                       "title", "url", "error"])


_ROOT: Path | None = None


ROOT_PREFIX = "prism-exports-"


def export_root() -> Path:
    """This process's export folder (made on first use, named with the process id; the folders that processes no
    longer running left behind are deleted then)."""
    global _ROOT
    if _ROOT is None or not _ROOT.is_dir():
        sweep_dead_roots()
        _ROOT = Path(tempfile.mkdtemp(prefix=f"{ROOT_PREFIX}{os.getpid()}-"))
    return _ROOT


def sweep_dead_roots(parent: Path | None = None) -> int:
    """Delete the export folders of app processes that are no longer running (a killed app cannot sweep its own);
    returns how many went. A folder whose name carries no process id is left alone."""
    gone = 0
    for folder in Path(parent or tempfile.gettempdir()).glob(f"{ROOT_PREFIX}*-*"):
        pid = folder.name[len(ROOT_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        gone += 1
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def sweep(max_age_s: float, now: float | None = None) -> int:
    """Delete the export folders older than max_age_s; returns how many went."""
    now = time.time() if now is None else now
    gone = 0
    for folder in export_root().iterdir():
        try:
            if now - folder.stat().st_mtime > max_age_s:
                shutil.rmtree(folder, ignore_errors=True)
                gone += 1
        except OSError:
            continue
    return gone


def _out(name: str, max_age_s: float) -> Path:
    sweep(max_age_s)
    folder = Path(tempfile.mkdtemp(dir=export_root()))
    return folder / re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def write_json(data: dict, name: str, max_age_s: float = 3600) -> str:
    path = _out(name, max_age_s)
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False, default=float))
    return str(path)


def write_csv(frame: pd.DataFrame, name: str, max_age_s: float = 3600) -> str:
    path = _out(name, max_age_s)
    frame.to_csv(path, index=False)
    return str(path)


def export_interventions(studio: Studio, session: Session) -> str:
    if not session.items and session.controller is None:
        raise AppError("there are no interventions to export: suppress or scale a prototype first")
    return write_json(interventions_json(studio, session), "prism-interventions.json", studio.limits.file_max_age_s)


def export_generation(studio: Studio, session: Session) -> str:
    return write_json(generation_json(studio, session), "prism-generation.json", studio.limits.file_max_age_s)


def export_table(studio: Studio) -> str:
    return write_csv(table_frame(studio), "prism-prototypes.csv", studio.limits.file_max_age_s)


def export_evidence(studio: Studio, prototype_id) -> str:
    pid = studio.check_prototype(prototype_id)
    return write_csv(evidence_frame(studio, pid), f"prism-evidence-{pid}.csv", studio.limits.file_max_age_s)

