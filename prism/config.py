"""PrismConfig: the hyper-parameters of the prototype head plus the backbone's own config, saved with every checkpoint.

A transformers `PreTrainedConfig` with model_type "prism", so `AutoConfig` and `AutoModelForCausalLM` read a PRISM
folder once `import prism` has registered the type. The backbone's config is nested under `text_config`, the way
composite transformers models (Llava, Gemma 3, ...) nest their language model's config: transformers then finds the
vocabulary, the end-of-text ids and the cache layout there (`config.get_text_config()`). The fields below describe
only what PRISM adds on top (the prototype bank, its sparsity and the weights of the auxiliary losses);
docs/DESIGN.md sections 1 and 2.

    PrismConfig(n_prototypes=64, top_k=4)               # text_config is filled in by PrismForCausalLM.from_backbone
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, PreTrainedConfig
from transformers.configuration_utils import SubConfigSpec

WEIGHT_KINDS = ("full", "trainable")


@strict
class PrismConfig(PreTrainedConfig):
    model_type = "prism"
    # optional: a config made before the backbone is chosen has none; from_backbone fills it in.
    sub_configs_defaults = {"text_config": SubConfigSpec(config_class=AutoConfig, model_type="llama", optional=True)}

    # The backbone's own transformers config (a dict when read from config.json, a config object after).
    text_config: dict | PreTrainedConfig | None = None
    # K: size of the prototype bank. The paper's 1.6B model uses 16,384; 512-2048 suit a 135M backbone.
    n_prototypes: int = 1024
    # k: prototypes kept per token. Small k keeps the decomposition readable (a handful of slices per token).
    top_k: int = 8
    # Weight of L_REC = ||r||^2 / ||z||^2: how much of z the prototypes must explain.
    lambda_rec: float | int = 1.0
    # Weight of L_R1: every prototype is pulled towards its nearest token state (prototypes sit on real data).
    lambda_r1: float | int = 0.1
    # Weight of L_R2: every token state is pulled towards its nearest prototype (every token is covered).
    lambda_r2: float | int = 0.1
    # Weights of the terms that ask the prototype path W z_hat + b to carry the prediction (prism/losses.py): its
    # own cross-entropy, its KL from the full model's distribution, and the residual measured through the head.
    # 0 (the default, and every checkpoint made before they existed) leaves the paper's objective unchanged.
    lambda_path_ce: float | int = 0.0
    lambda_path_kl: float | int = 0.0
    lambda_head_rec: float | int = 0.0
    # Where the backbone came from ('smollm2', a hub id or a local folder). Needed to reload a checkpoint that
    # was saved without the frozen backbone weights (save_pretrained(trainable_only=True)).
    backbone: str | None = None
    # sha256 over the frozen backbone tensors, checked when a trainable-only checkpoint is loaded, so a
    # checkpoint never silently runs on a different backbone than the one it was trained on.
    backbone_fingerprint: str | None = None
    # What model.safetensors beside this config holds: "full" (every tensor) or "trainable" (the parameters that
    # were trained; the frozen rest is rebuilt from `backbone` and checked against `backbone_fingerprint`).
    weights: str = "full"
    # Free-form facts about the run that produced the checkpoint (corpus, versions); saved, never interpreted.
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self, **kwargs) -> None:
        super().__post_init__(**kwargs)
        if isinstance(self.n_prototypes, bool) or self.n_prototypes < 1:
            raise ValueError(f"n_prototypes must be a positive integer, got {self.n_prototypes!r}")
        if isinstance(self.top_k, bool) or self.top_k < 1:
            raise ValueError(f"top_k must be a positive integer, got {self.top_k!r}")
        if self.top_k > self.n_prototypes:
            raise ValueError(
                f"top_k ({self.top_k}) cannot exceed n_prototypes ({self.n_prototypes}): "
                "a token cannot use more prototypes than the bank holds"
            )
        for name in LAMBDAS:
            value = getattr(self, name)
            if isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative number, got {value!r}")
        if self.weights not in WEIGHT_KINDS:
            raise ValueError(f"weights must be one of {WEIGHT_KINDS}, got {self.weights!r}")

    def prism_dict(self) -> dict[str, Any]:
        """Only the fields PRISM adds (no backbone config, no transformers bookkeeping): what runs record."""
        return {name: getattr(self, name) for name in PRISM_FIELDS}


LAMBDAS = ("lambda_rec", "lambda_r1", "lambda_r2", "lambda_path_ce", "lambda_path_kl", "lambda_head_rec")
PRISM_FIELDS = ("n_prototypes", "top_k", *LAMBDAS, "backbone", "backbone_fingerprint", "weights", "metadata")
