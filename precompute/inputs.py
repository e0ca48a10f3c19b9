"""What the precompute jobs read, in one place: the model (a folder written by PrismForCausalLM.save_pretrained
with its tokenizer beside it, or the shipped default), the corpus (a spec: 'default', a local path or a hub
dataset id) with the identities stored beside every job's output, and the distributed set-up under torchrun.

    model, tokenizer, model_identity = load_model("runs/prism/final")      # or "default": assets/model
    documents, corpus_identity = load_corpus("default")                     # re-iterable, same order every pass
    setup_distributed()                                                     # gloo process group under torchrun

The jobs' own command lines and `python -m precompute build` load their inputs through here; nothing imports
precompute/__main__.py.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch.distributed as dist

from prism import PrismForCausalLM
from prism.backbones import load_tokenizer

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "assets" / "model"


def setup_distributed() -> None:
    """Join the process group torchrun describes (WORLD_SIZE > 1), once; a single process does nothing."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")


def rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def model_folder(spec: str) -> Path:
    """The folder a model spec names: 'default' is the shipped assets/model."""
    folder = DEFAULT_MODEL if spec == "default" else Path(spec)
    if spec == "default" and not folder.exists():
        raise FileNotFoundError(f"no default model is shipped yet ({folder}); give --model a folder written by "
                                "PrismForCausalLM.save_pretrained")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not a PRISM model folder (no config.json); "
                                "give a folder written by PrismForCausalLM.save_pretrained")
    return folder


def load_model(spec: str):
    """(model, tokenizer, identity) for a save_pretrained folder with its tokenizer beside it, or 'default'."""
    folder = model_folder(spec)
    model = PrismForCausalLM.from_pretrained(folder).eval()
    try:
        tokenizer = load_tokenizer(str(folder))
    except ValueError as err:
        raise ValueError(f"{folder} has no tokenizer saved beside the model: {err}") from err
    identity = {"path": folder.name, "weights_sha256": file_sha256(folder / "model.safetensors"),
                "n_prototypes": model.config.n_prototypes, "top_k": model.config.top_k}
    return model, tokenizer, identity


def load_corpus(spec: str):
    """(documents iterable, identity) for a corpus spec: a path, a hub dataset id or 'default'."""
    from precompute import corpus

    class Documents:  # re-iterable: every pass re-reads the source in the same order
        def __iter__(self):
            return corpus.iter_documents(spec)

    identity: dict = {"spec": spec if not Path(spec).exists() else Path(spec).name}
    if spec == "default":
        identity["manifest"] = corpus.default_manifest()
    elif Path(spec).exists():
        from prism.data import corpus_fingerprint

        identity["sha256"] = corpus_fingerprint(spec)
    return Documents(), identity
