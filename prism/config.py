"""PrismConfig: the hyper-parameters of the prototype head, saved with every checkpoint.

The backbone keeps its own transformers config; this dataclass only describes what PRISM adds on top
(the prototype bank, its sparsity and the weights of the auxiliary losses). See PRISM.md section 1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PrismConfig:
    # K: size of the prototype bank. The paper's 1.6B model uses 16,384; 512-2048 suit a 135M backbone.
    n_prototypes: int = 1024
    # k: prototypes kept per token. Small k keeps the decomposition readable (a handful of slices per token).
    top_k: int = 8
    # Weight of L_REC = ||r||^2 / ||z||^2: how much of z the prototypes must explain.
    lambda_rec: float = 1.0
    # Weight of L_R1: every prototype is pulled towards its nearest token state (prototypes sit on real data).
    lambda_r1: float = 0.1
    # Weight of L_R2: every token state is pulled towards its nearest prototype (every token is covered).
    lambda_r2: float = 0.1
    # Where the backbone came from ('smollm2', a hub id or a local folder). Needed to reload a checkpoint that
    # was saved without the frozen backbone weights (save_pretrained(trainable_only=True)).
    backbone: str | None = None
    # sha256 over the frozen backbone tensors, checked when a trainable-only checkpoint is loaded, so a
    # checkpoint never silently runs on a different backbone than the one it was trained on.
    backbone_fingerprint: str | None = None
    # Free-form facts about the run that produced the checkpoint (corpus, versions); saved, never interpreted.
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.n_prototypes, int) or self.n_prototypes < 1:
            raise ValueError(f"n_prototypes must be a positive integer, got {self.n_prototypes!r}")
        if not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"top_k must be a positive integer, got {self.top_k!r}")
        if self.top_k > self.n_prototypes:
            raise ValueError(
                f"top_k ({self.top_k}) cannot exceed n_prototypes ({self.n_prototypes}): "
                "a token cannot use more prototypes than the bank holds"
            )
        for name in ("lambda_rec", "lambda_r1", "lambda_r2"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a non-negative number, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrismConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown PrismConfig fields {unknown}; known fields are {sorted(known)}")
        return cls(**data)
