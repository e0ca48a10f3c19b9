"""Prototype controllers: a fitted, sparse reweighting of the active prototypes, and its file format.

docs/DESIGN.md section 3 (interventions, controllers): at every position the model's own active prototypes keep their
ids and their activations are multiplied by fitted per-prototype factors,

    a'_{t,i} = exp(g_i) * a_{t,i}   for i in K_t,   so   l'_t = l_t + sum_{i in K_t} (exp(g_i) - 1) a_{t,i} W p_i

a linear (diagonal) map of the active-prototype vector with K parameters g, most of them exactly 0 (factor 1).
Activations stay >= 0 and every change of a logit is a sum of named prototypes' slices, so each correction points at
the prototypes it moved and, through their evidence, at their training neighbourhoods. A full K x K map would have
K^2 parameters for a few hundred labelled items and no longer one number per prototype. The controller is applied
as `Interventions(controller=...)`, so head, forward, decompose, stream and generate (and the app) use it like
suppression and steering. Fitting one is prism/controller_fit.py; the experiment that compares it with a dense
baseline on held-out tasks is bench/controllers.py.

    controller = load_controller("assets/controllers/next_sentence.safetensors", model)   # refuses other models
    model.generate(ids, max_new_tokens=20, interventions=Interventions(controller=controller))
    controller.top(5)              # {"raised": [{prototype_id, factor}, ...], "lowered": [...]}
    save_controller(controller, "ctl.safetensors")

A controller file is safetensors: its tensors (log_factors (K,), and whatever else its kind needs) and its
description as JSON in the header (kind, format version, what it was fitted on, the fingerprint of the prototype
bank it belongs to). load_controller reads prototype controllers only; read_controller_file gives any kind's parts.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from prism.model import PrismForCausalLM

FORMAT_VERSION = 1
METADATA_KEY = "prism_controller"
KIND = "prototype"
# Header fields that describe the file, not the fit (they are not part of a loaded controller's meta).
FILE_FIELDS = ("kind", "format_version", "n_prototypes", "n_moved")


@dataclass(frozen=True, eq=False)
class PrototypeController:
    """Per-prototype factors exp(g) on the active activations. log_factors (K,); 0 means untouched."""

    log_factors: torch.Tensor  # (K,)
    meta: dict = field(default_factory=dict)  # what it was fitted on and how (saved with it)

    kind = KIND

    def __post_init__(self) -> None:
        check_log_factors(self.log_factors)

    def __repr__(self) -> str:
        return (f"PrototypeController(task={self.meta.get('task')!r}, seed={self.meta.get('seed')!r}, "
                f"K={self.n_prototypes}, moved={len(self.moved())})")

    @property
    def n_prototypes(self) -> int:
        return int(self.log_factors.shape[0])

    @property
    def n_parameters(self) -> int:
        return self.n_prototypes

    @property
    def factors(self) -> torch.Tensor:
        return self.log_factors.exp()

    def reweight(self, ids: torch.Tensor, acts: torch.Tensor) -> torch.Tensor:
        """ids (..., k), acts (..., k) >= 0 -> acts * factor[ids] (..., k) >= 0."""
        return acts * self.log_factors.to(acts.dtype).exp()[ids]

    def restricted(self, prototype_ids: set[int]) -> PrototypeController:
        keep = torch.zeros_like(self.log_factors, dtype=torch.bool)
        ids = [i for i in prototype_ids if 0 <= int(i) < self.n_prototypes]
        keep[torch.tensor(ids, dtype=torch.long)] = True
        return PrototypeController(torch.where(keep, self.log_factors, torch.zeros_like(self.log_factors)),
                                   dict(self.meta))

    def moved(self) -> list[int]:
        return torch.nonzero(self.log_factors).flatten().tolist()

    def top(self, n: int = 10) -> dict[str, list[dict]]:
        """The n most raised and the n most lowered prototypes: {"raised": [...], "lowered": [...]}, each row
        {prototype_id, factor}."""
        g = self.log_factors.detach()
        order = g.argsort(descending=True).tolist()
        rows = lambda ids: [{"prototype_id": int(i), "factor": float(g[i].exp())} for i in ids]  # noqa: E731
        return {"raised": rows([i for i in order if g[i] > 0][:n]),
                "lowered": rows([i for i in reversed(order) if g[i] < 0][:n])}

    def tensors(self) -> dict[str, torch.Tensor]:
        """What its file stores."""
        return {"log_factors": self.log_factors.detach().float().contiguous()}


def check_log_factors(g: torch.Tensor) -> None:
    if not isinstance(g, torch.Tensor) or g.dim() != 1 or g.shape[0] == 0:
        raise ValueError("log_factors must be a non-empty 1-d tensor (one entry per prototype)")
    if not bool(torch.isfinite(g).all()):
        raise ValueError("log_factors must be finite (factors exp(g) stay > 0, activations >= 0)")


# ----------------------------------------------------------------------------------------------------------------
# Files: one safetensors file per controller, its description as JSON in the header.


def bank_fingerprint(model: PrismForCausalLM) -> str:
    """sha256 of the prototype bank: every trained checkpoint has its own."""
    digest = hashlib.sha256()
    digest.update(json.dumps([model.config.n_prototypes, model.d_model, model.vocab_size]).encode())
    digest.update(model.prototypes.weight.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def save_controller(controller, path: str | Path) -> Path:
    """Write a controller (any kind with kind, n_prototypes, meta, moved() and tensors()) atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format_version": FORMAT_VERSION, "kind": controller.kind, "n_prototypes": controller.n_prototypes,
            "n_moved": len(controller.moved()), **controller.meta}
    tmp = path.with_name(path.name + ".partial")
    save_file(controller.tensors(), str(tmp), metadata={METADATA_KEY: json.dumps(meta, default=str)})
    tmp.replace(path)
    return path


def read_controller_file(path: str | Path) -> tuple[str, dict[str, torch.Tensor], dict]:
    """(kind, tensors, description) of a controller file of any kind; clear errors for anything else."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no controller file at {path}")
    try:
        with safe_open(str(path), "pt") as f:
            header = f.metadata() or {}
        tensors = load_file(str(path))
        meta = json.loads(header[METADATA_KEY])
        kind = meta["kind"]
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError, TypeError) as err:
        raise ValueError(f"{path} is not a PRISM controller file (safetensors with its description): {err}") from err
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path} has controller format {meta.get('format_version')}, this code reads "
                         f"{FORMAT_VERSION}")
    return kind, tensors, {k: v for k, v in meta.items() if k not in FILE_FIELDS}


def load_controller(path: str | Path, model: PrismForCausalLM | None = None) -> PrototypeController:
    """Read a prototype controller file; with a model, refuse one fitted for another model (clear ValueError)."""
    kind, tensors, description = read_controller_file(path)
    if kind == "dense":
        raise ValueError(f"{path} holds the dense baseline (an edit of the hidden state, not of prototypes): only "
                         "prototype controllers apply to a PRISM model (bench/dense_controller.py reads it)")
    if kind != KIND:
        raise ValueError(f"{path}: unknown controller kind {kind!r} (this code reads {KIND!r})")
    controller = PrototypeController(tensors["log_factors"], description)
    if model is not None:
        check_controller(controller, model, str(path))
    return controller


def check_controller(controller, model: PrismForCausalLM, name: str = "the controller") -> None:
    """Refuse a controller fitted for another model: another bank size, or another bank (fingerprint)."""
    if controller.n_prototypes != model.config.n_prototypes:
        raise ValueError(f"{name} was fitted for a model with {controller.n_prototypes} prototypes but this model "
                         f"has {model.config.n_prototypes}: it belongs to another model")
    expected = controller.meta.get("bank_fingerprint")
    if expected and expected != bank_fingerprint(model):
        raise ValueError(f"{name} was fitted on another checkpoint (prototype bank fingerprint mismatch): fit it "
                         "again for this model")
