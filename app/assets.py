"""Where the shipped default model and precompute database live. The only module that knows these paths:
the issue that ships them drops files into assets/ and nothing else changes.

    assets/model/          a PRISM checkpoint folder (config.json, model.safetensors, tokenizer files)
    assets/*.duckdb        the precompute database for that model (the first in name order is used)
    assets/controllers/    fitted prototype controllers for that model, offered by name (file stem)
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "assets"
DEFAULT_MODEL = ASSETS / "model"
CONTROLLERS = ASSETS / "controllers"


class MissingModel(FileNotFoundError):
    pass


def resolve_model(path: str | Path | None) -> Path:
    """The model folder to load: the given one, else the shipped default; a clear error when there is none."""
    if path is None:
        if not (DEFAULT_MODEL / "config.json").is_file():
            raise MissingModel(f"no shipped default model at {DEFAULT_MODEL}: pass --model PATH (a folder written by "
                               "PrismForCausalLM.save_pretrained, with its tokenizer saved beside it)")
        return DEFAULT_MODEL
    path = Path(path)
    if not (path / "config.json").is_file():
        raise MissingModel(f"{path} is not a PRISM model folder (no config.json)")
    return path


def resolve_db(path: str | Path | None, model_given: bool) -> Path | None:
    """The database to open: the given one; with no --db and the default model, the shipped assets/*.duckdb;
    None when there is none (the app then runs without evidence)."""
    if path is not None:
        return Path(path)
    if model_given:
        return None
    found = sorted(ASSETS.glob("*.duckdb"))
    return found[0] if found else None


def shipped_controllers() -> dict[str, Path]:
    """{name: file} of the shipped controllers (assets/controllers/NAME.safetensors), by name."""
    return {p.stem: p for p in sorted(CONTROLLERS.glob("*.safetensors"))}
