"""The app's controller panel logic, without any UI: load a fitted prototype controller (prism/controllers.py) for
one session, and describe it: which prototypes it raises and lowers most, with their labels and top evidence.

    controller = load(studio, "runs/prism/ctl/next_sentence/prototype-seed0.safetensors")
    view = describe(studio, controller)        # {"name", "task", "moved", "raised": [...], "lowered": [...]}
    session = replace(session, controller=controller, controller_on=True)   # session.interventions() uses it

The controller is a value kept in the user's Session (gr.State), never on the Studio: switching it on changes only
that user's generations, through the same Interventions as suppression and scaling.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from app.assets import shipped_controllers
from app.core import AppError, Studio
from app.session import MAX_SCALE
from prism.controllers import PrototypeController, load_controller

SUFFIX = ".safetensors"
MAX_FACTOR = MAX_SCALE  # the largest factor a loaded controller may apply, as for Scale
SNIPPET_CHARS = 160


def load(studio: Studio, path: str | Path | None, upload: bool = False) -> PrototypeController:
    """A prototype controller file for this studio's model; AppError with the reason otherwise. Messages name the
    file, never its folder on the server. A path typed by the user is refused when the app's limits say so (on a
    Space); uploads over the size limit are refused before reading."""
    if path is None or not str(path).strip():
        raise AppError("give the path of a controller file (python -m bench.controllers fit writes them) or "
                       "upload one")
    if not upload and not studio.limits.server_paths and shipped_name(path) is None:
        raise AppError("this app does not read files on the server: pick a shipped controller or upload a file")
    path = Path(str(path).strip())
    if path.suffix != SUFFIX:
        raise AppError(f"a controller file ends with {SUFFIX}, got {path.name[:80]!r}")
    try:
        size = path.stat().st_size if path.is_file() else None
    except OSError as err:  # e.g. a name too long for the file system
        raise AppError(f"cannot read {path.name[:80]!r}: {err.strerror or 'not a usable file name'}") from None
    if size is None:
        raise AppError(f"no controller file {path.name[:80]!r}" + ("" if upload else " on the server"))
    if size > studio.limits.max_upload_bytes:
        raise AppError(f"{path.name[:80]!r} has {size:,} bytes; a controller file here is at most "
                       f"{studio.limits.max_upload_bytes:,}")
    try:
        controller = load_controller(path, studio.model)
    except (FileNotFoundError, ValueError, OSError) as err:
        raise AppError(f"cannot use this controller: {str(err).replace(str(path), path.name)[:300]}") from None
    g = controller.log_factors
    if not torch.isfinite(g).all() or float(g.max()) > math.log(MAX_FACTOR) + 1e-6:  # float32 rounding
        raise AppError(f"this controller raises a prototype by more than x{MAX_FACTOR:g} (or holds a value that is "
                       "not a number): such factors overflow the logits, so it is refused")
    return controller


def shipped(studio: Studio) -> dict[str, Path]:
    """The shipped controllers that fit this studio's model ({name: file}): each is fitted to one prototype bank,
    so with another model there are none."""
    fits = {}
    for name_, file in shipped_controllers().items():
        try:
            load(studio, file)
        except AppError:
            continue
        fits[name_] = file
    return fits


def load_shipped(studio: Studio, name: str) -> PrototypeController:
    files = shipped(studio)
    if str(name) not in files:
        raise AppError(f"no shipped controller {str(name)[:60]!r}; shipped for this model: "
                       f"{', '.join(files) or 'none'}")
    return load(studio, files[str(name)])


def shipped_name(path: str | Path) -> str | None:
    """The shipped name of a controller file, None when it is not one of the shipped files."""
    try:
        resolved = Path(str(path).strip()).resolve()
    except OSError:
        return None
    return next((name for name, file in shipped_controllers().items() if file.resolve() == resolved), None)


def name(controller: PrototypeController) -> str:
    meta = controller.meta
    moved = len(controller.moved())
    return f"{meta.get('task', 'controller')} (seed {meta.get('seed', '?')}, {moved} prototypes moved)"


def describe(studio: Studio, controller: PrototypeController, n: int = 10) -> dict:
    """The n most raised and lowered prototypes with label, category and, with a database, the top evidence."""
    rows = controller.top(n)
    for direction in ("raised", "lowered"):
        for row in rows[direction]:
            label, category = studio.label(row["prototype_id"])
            row.update(label=label, category=category, evidence=_snippet(studio, row["prototype_id"]))
    meta = controller.meta
    return {"name": name(controller), "task": meta.get("task"), "seed": meta.get("seed"),
            "moved": len(controller.moved()), "val_accuracy": meta.get("val_accuracy"),
            "val_accuracy_before": meta.get("val_accuracy_before"), **rows}


def _snippet(studio: Studio, prototype_id: int) -> str:
    """The top evidence context as plain text with the token in [brackets]; "" without a database."""
    if studio.db is None:
        return ""
    try:
        evidence = studio.need_db().card(prototype_id, n_evidence=1).evidence
    except AppError:
        return ""
    if not evidence:
        return ""
    text = "".join(f"[{s['text']}]" if s["target"] else s["text"] for s in evidence[0]["segments"])
    return " ".join(text.split())[:SNIPPET_CHARS]


def table_rows(view: dict) -> list[list]:
    """The description as table rows: direction, prototype id, factor, label, category, evidence."""
    return [[direction, r["prototype_id"], round(r["factor"], 3), r["label"], r["category"], r["evidence"]]
            for direction in ("raised", "lowered") for r in view[direction]]
