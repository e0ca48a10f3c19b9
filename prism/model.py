"""PRISM model: any transformers causal LM whose prediction is routed through a sparse prototype bank.

Reads top to bottom: the prototype bank, the outputs, then the wrapper model with forward, decompose, generation
and checkpoint I/O (the intervention values it applies are prism/interventions.py). The wrapper is a transformers
PreTrainedModel with GenerationMixin: `import prism` registers it with the Auto classes, generate() is
transformers' own (every decoding option, with interventions applied at every step) and stream() is the
explain-while-generating loop over the same forward. The math is docs/DESIGN.md section 1:

    sims_t   = cos(z_t, p_i) for all i                       (B, T, K)
    K_t      = top-k of sims_t,  a_{t,i} = ReLU(sims_t,i)    (B, T, k)
    z_hat_t  = sum_{i in K_t} a_{t,i} p_i,   r_t = z_t - z_hat_t
    l_t      = W z_t + b = (W r_t + b) + sum_{i in K_t} a_{t,i} (W p_i)

so the logit of any token splits exactly into a residual slice and one slice per active prototype. An
intervention changes the selection and activations (a suppressed set re-routed or zeroed, a fitted controller's
reweighting, scale, inject) and therefore z and the logits at that position only; the backbone's KV cache is
untouched, which is why interventions work inside cached generation.

Usage:
    from prism import PrismConfig, PrismForCausalLM, Interventions
    model = PrismForCausalLM.from_backbone(backbone, PrismConfig(n_prototypes=64, top_k=4))
    out = model(input_ids, labels=input_ids)
    d = model.decompose(input_ids, position=-1)
    ids = model.generate(input_ids, max_new_tokens=20, interventions=Interventions(suppress={3}))
    model = AutoModelForCausalLM.from_pretrained(folder)      # after `import prism`

Length: about 960 lines, on purpose. As in transformers' single-model-file policy, the whole model (the bank, the
outputs, forward, decompose, generation, checkpoints) is one file that reads top to bottom, so the math above and
every place that applies it sit side by side; split up, one forward pass would be spread over files that only ever
change together. The intervention values it applies are in prism/interventions.py.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.modeling_outputs import CausalLMOutputWithPast

from prism.config import PrismConfig
from prism.interventions import (  # noqa: F401  (re-exported: prism.model.Interventions stays importable)
    SUPPRESS_MODES,
    ActivationController,
    Interventions,
    changed_selection,
)
from prism.losses import NORMALIZE_EPS, head_gram, prism_loss

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
GENERATION_CONFIG_NAME = "generation_config.json"
# The similarities' backward multiplies their gradient by the bank and the states. In training that gradient is
# almost all zeros (the top-k entries, one maximum per token for R2 and per prototype for R1: about (k + 2) / K of
# it), so on CPU a sparse product is several times cheaper; above this share of non-zeros the dense one is used.
SPARSE_GRAD_MAX_DENSITY = 0.05


# ----------------------------------------------------------------------------------------------------------------
# The prototype bank.


class PrototypeBank(nn.Module):
    """K free vectors p_i in R^d; their norms are learned, their directions decide activation."""

    def __init__(self, n_prototypes: int, d_model: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_prototypes, d_model) / math.sqrt(d_model))  # (K, d)

    def similarities(self, z: torch.Tensor) -> torch.Tensor:
        """Cosine similarity of every token state with every prototype. z (..., d) -> (..., K)."""
        zn = F.normalize(z, dim=-1).reshape(-1, z.shape[-1])  # (N, d)
        sims = _Similarities.apply(zn, F.normalize(self.weight, dim=-1))  # (N, K)
        return sims.reshape(*z.shape[:-1], self.weight.shape[0])

    def route(self, z: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """similarities and the top-k of activate in one step whose backward never builds a (tokens, K) gradient
        (training's way; _Routing). z (..., d) -> sims (..., K) without gradient, ids (..., k) long, and the top-k
        similarities (..., k) before ReLU, with gradient: activations are their ReLU, and values[..., 0] is each
        token's best similarity (R2's)."""
        sims, values, ids = _Routing.apply(z.reshape(-1, z.shape[-1]), self.weight, top_k)
        lead = z.shape[:-1]
        return sims.reshape(*lead, -1), ids.reshape(*lead, top_k), values.reshape(*lead, top_k)

    def activate(self, sims: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the top-k similarities, ReLU them. sims (..., K) -> ids (..., k) long, activations (..., k) >= 0."""
        values, ids = sims.topk(top_k, dim=-1)  # (..., k)
        return ids, F.relu(values)

    def reconstruct(self, ids: torch.Tensor, activations: torch.Tensor) -> torch.Tensor:
        """z_hat = sum_j a_j p_{ids_j}. ids, activations (..., k) -> (..., d).

        embedding_bag sums the k weighted rows without materialising them (a gather would build (..., k, d) and
        scatter-add it back in the backward; a dense (..., K) activation matrix times the bank does K/k times the
        work): on CPU about ten times cheaper than either, forward and backward (bench.train_throughput)."""
        k, d = ids.shape[-1], self.weight.shape[1]
        flat = F.embedding_bag(ids.reshape(-1, k), self.weight, mode="sum",
                               per_sample_weights=activations.reshape(-1, k).to(self.weight.dtype))  # (N, d)
        # in the wider of the two types: under autocast the activations are bfloat16 and z_hat stays float32 (a
        # bfloat16 z_hat was rounded, then widened again for L_REC: two casts each way a step for nothing)
        return flat.reshape(*ids.shape[:-1], d).to(torch.promote_types(activations.dtype, self.weight.dtype))


class _Similarities(torch.autograd.Function):
    """zn (N, d) @ pn (K, d).T, whose backward multiplies a mostly-zero gradient sparsely on CPU (see
    SPARSE_GRAD_MAX_DENSITY); the result equals the dense product's up to float summation order."""

    @staticmethod
    def forward(ctx, zn: torch.Tensor, pn: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(zn, pn)
        return zn @ pn.T  # (N, K)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        zn, pn = ctx.saved_tensors
        # Under autocast the product (and so its gradient) is bfloat16 while zn and pn are float32: multiply in the
        # wider type (autograd casts each result back to its input's dtype).
        dtype = torch.promote_types(torch.promote_types(zn.dtype, pn.dtype), grad.dtype)
        grad, zn, pn = grad.to(dtype), zn.to(dtype), pn.to(dtype)
        if grad.device.type == "cpu" and grad.dtype == torch.float32:
            sparse = grad.to_sparse()
            if sparse._nnz() <= SPARSE_GRAD_MAX_DENSITY * grad.numel():
                grad_zn = torch.sparse.mm(sparse, pn) if ctx.needs_input_grad[0] else None  # (N, d)
                grad_pn = torch.sparse.mm(sparse.t(), zn) if ctx.needs_input_grad[1] else None  # (K, d)
                return grad_zn, grad_pn
        return (grad @ pn if ctx.needs_input_grad[0] else None,
                grad.T @ zn if ctx.needs_input_grad[1] else None)


def _normalize_backward(grad: torch.Tensor, unit: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """The gradient through F.normalize(x) = x / max(|x|, eps): grad (n, d) of the unit vectors `unit`, norm (n, 1)
    = max(|x|, eps) -> the gradient of x, (grad - (grad . unit) unit) / norm (the radial part only where |x| > eps,
    as autograd's)."""
    radial = torch.linalg.vecdot(grad, unit).unsqueeze(-1) * (norm > NORMALIZE_EPS)  # (n, 1), no (n, d) product
    return torch.addcmul(grad, radial, unit, value=-1.0).div_(norm)


class _Routing(torch.autograd.Function):
    """cos(z_n, p_i) for every token and prototype and its top-k, z (N, d) and the bank w (K, d) -> sims (N, K)
    (no gradient), the top-k values (N, k) and ids (N, k).

    Its backward needs only the values' gradient, k entries per token: the states' gradient is a weighted sum of k
    unit prototypes (embedding_bag), the bank's a sparse product, and both normalisations' backward are written out.
    Autograd's way (a dense similarity matrix whose top-k, row maximum and column maximum each build a (N, K)
    gradient, summed, then made sparse) spent about as long again as the product itself (bench.train_throughput
    --profile). Under autocast the product is bfloat16 as before and the gradients are computed in float32."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, w: torch.Tensor, top_k: int):
        z_norm = z.norm(dim=-1, keepdim=True).clamp_min(NORMALIZE_EPS)  # (N, 1)
        w_norm = w.norm(dim=-1, keepdim=True).clamp_min(NORMALIZE_EPS)  # (K, 1)
        zn, pn = z / z_norm, w / w_norm
        sims = zn @ pn.T  # (N, K), bfloat16 under autocast
        values, ids = sims.topk(top_k, dim=-1)  # (N, k)
        ctx.save_for_backward(zn, pn, z_norm, w_norm, ids)
        ctx.mark_non_differentiable(sims, ids)
        ctx.set_materialize_grads(False)  # no (N, K) zeros for the sims' missing gradient
        return sims, values, ids

    @staticmethod
    def backward(ctx, _sims_grad, values_grad, _ids_grad):
        if values_grad is None:
            return None, None, None
        zn, pn, z_norm, w_norm, ids = ctx.saved_tensors
        dtype = torch.promote_types(torch.promote_types(zn.dtype, pn.dtype), values_grad.dtype)
        grad, zn, pn = values_grad.to(dtype), zn.to(dtype), pn.to(dtype)
        n, k = ids.shape
        grad_z = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_zn = F.embedding_bag(ids, pn, mode="sum", per_sample_weights=grad)  # (N, d) sum_j g_nj p_ids_nj
            grad_z = _normalize_backward(grad_zn, zn, z_norm.to(dtype))  # autograd casts it to z's dtype
        if ctx.needs_input_grad[1]:
            tokens = torch.arange(n, device=ids.device).repeat_interleave(k)  # (N k,)
            entries = torch.sparse_coo_tensor(torch.stack([ids.reshape(-1), tokens]), grad.reshape(-1),
                                              (pn.shape[0], n), check_invariants=False)  # valid by construction
            grad_pn = torch.sparse.mm(entries, zn)  # (K, d)
            grad_w = _normalize_backward(grad_pn, pn, w_norm.to(dtype))
        return grad_z, grad_w, None


# ----------------------------------------------------------------------------------------------------------------
# Outputs.


@dataclass
class PrismOutput(CausalLMOutputWithPast):
    """transformers' causal-LM output (loss, logits, cache, hidden_states, attentions) plus the prototype state.

    loss/losses only when labels are given; cache only when use_cache=True. With logits_to_keep=n every per-position
    field covers the last n positions only (what generate asks for).
    logits (B, T, V) are the intervened logits when interventions are given; prototype_ids/activations are the
    model's own top-k (before interventions) and residual is r = z - z_hat, which interventions do not change.
    used_prototype_ids/used_activations (B, T, k') are what the logits actually use when interventions are given
    (re-routed selection, controller, suppress, scale, then injected entries at k..): logits = W (r + sum_j
    used_activations_j p_{used_prototype_ids_j}) + b. None without interventions (then they are the model's own).
    """

    losses: dict[str, torch.Tensor] | None = None
    prototype_ids: torch.Tensor | None = None  # (B, T, k) long
    activations: torch.Tensor | None = None  # (B, T, k) >= 0
    residual: torch.Tensor | None = None  # (B, T, d)
    z: torch.Tensor | None = None  # (B, T, d) final hidden state, the input of the LM head
    z_hat: torch.Tensor | None = None  # (B, T, d)
    sims: torch.Tensor | None = None  # (B, T, K), only with return_sims=True (no gradient without interventions)
    top_similarity: torch.Tensor | None = None  # (B, T) each token's best similarity, with gradient (R2's)
    used_prototype_ids: torch.Tensor | None = None  # (B, T, k') long, only with interventions
    used_activations: torch.Tensor | None = None  # (B, T, k') >= 0, only with interventions


@dataclass
class Decomposition:
    """One token's logit at one position, split exactly: residual + sum(contributions) == logit.

    prototype_ids/activations/contributions are the effective ones (after interventions), ordered by activation;
    a suppressed prototype does not appear, an injected one does. residual includes the LM head's bias.
    removed_ids: the model's own active prototypes at this position that the interventions switched off;
    rerouted_ids: the prototypes that entered the selection in their place (suppress_mode "reroute"; empty for
    "zero", where nothing takes their place).
    """

    token_id: int
    position: int
    logit: float
    residual: float
    prototype_ids: list[int]
    activations: list[float]
    contributions: list[float]
    removed_ids: list[int] = field(default_factory=list)
    rerouted_ids: list[int] = field(default_factory=list)


@dataclass
class GenerationStep:
    """What stream() yields per generated token: the tokens (B,) and their prototype state at that position."""

    step: int
    token_ids: torch.Tensor  # (B,)
    prototype_ids: torch.Tensor  # (B, k), the model's own top-k before interventions
    activations: torch.Tensor  # (B, k)
    logits: torch.Tensor  # (B, V), intervened logits the token was chosen from
    used_prototype_ids: torch.Tensor | None = None  # (B, k'), what the logits used; None without interventions
    used_activations: torch.Tensor | None = None  # (B, k')
    state: torch.Tensor | None = None  # (B, d) z at the position that chose the token (decompose it without a pass)
    # (B, t, d) with stream(keep_states_before=L): the states entering decoder layer L at the positions this step's
    # forward read (step 0: the prompt; later steps: the token before), e.g. a gradient store's query input
    layer_states: torch.Tensor | None = None


# ----------------------------------------------------------------------------------------------------------------
# Backbone plumbing: the few generic facts PRISM needs from any transformers decoder.


class _StopForward(Exception):
    """Raised by a pre-hook to end a forward pass once the states it wanted are captured."""


class _InjectedInput(nn.Module):
    """Wraps the first layer of a top-layer view and feeds it given states instead of what arrives from below.

    Lives only inside that view (never inside the real backbone), so ordinary forwards are never affected.
    """

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.states: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        if self.states is None:
            raise RuntimeError("top-layer view called without start states")
        if self.states.shape[:2] != hidden_states.shape[:2]:
            raise ValueError(f"start states have shape {tuple(self.states.shape)} but the inputs have "
                             f"(batch, length) {tuple(hidden_states.shape[:2])}")
        return self.layer(self.states.to(hidden_states.dtype), *args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["layer"], name)


def _decoder_layers(base: nn.Module, n_layers: int) -> tuple[str, nn.ModuleList]:
    """The backbone's list of decoder blocks: the direct ModuleList child with num_hidden_layers entries."""
    for name, child in base.named_children():
        if isinstance(child, nn.ModuleList) and len(child) == n_layers:
            return name, child
    raise ValueError(f"cannot find the decoder layer list (a ModuleList of {n_layers} blocks) in "
                     f"{type(base).__name__}; PRISM supports decoder-only transformers causal LMs")


# ----------------------------------------------------------------------------------------------------------------
# The model.


class _BackboneGenerationConfig(GenerationConfig):
    """transformers derives a model's decoding defaults from its config; PRISM's come from the backbone's config,
    because PrismConfig.top_k counts active prototypes and would be read as a top-k sampling filter."""

    @classmethod
    def from_model_config(cls, model_config):
        if isinstance(model_config, PrismConfig) and model_config.text_config is not None:
            model_config = model_config.text_config
        return GenerationConfig.from_model_config(model_config)


class PrismForCausalLM(PreTrainedModel, GenerationMixin):
    """A transformers causal LM backbone plus a prototype bank on its final hidden state.

    A transformers model in its own right: `from_pretrained`/`save_pretrained` (safetensors), `generate` with every
    decoding option (interventions=Interventions(...) applies at every step), Auto classes (registered by
    `import prism`), `.device`, pipelines and clients such as lm-eval's HFLM.
    """

    config_class = PrismConfig
    generation_config_class = _BackboneGenerationConfig
    base_model_prefix = "prism"  # no attribute has this name: checkpoint keys are never re-prefixed on load
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    # The backbone decides its attention; declaring support here keeps transformers from forcing it to eager.
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def __init__(self, config: PrismConfig, backbone: PreTrainedModel | None = None) -> None:
        if backbone is None:
            if config.text_config is None:
                raise ValueError("PrismConfig.text_config is empty: build the model with "
                                 "PrismForCausalLM.from_backbone(backbone, config) or load it with from_pretrained")
            backbone = AutoModelForCausalLM.from_config(config.text_config)
        else:
            config.text_config = backbone.config  # one config object: the nested one is the backbone's own
        super().__init__(config)
        if backbone.get_output_embeddings() is None:
            raise ValueError(f"{type(backbone).__name__} has no output embeddings (LM head); "
                             "PRISM needs a causal LM such as LlamaForCausalLM or GPT2LMHeadModel")
        if getattr(backbone.config, "final_logit_softcapping", None):
            raise ValueError("backbones with final logit soft-capping are not supported: "
                             "the capped logits no longer split additively over prototypes")
        self.backbone = backbone
        self.prototypes = PrototypeBank(config.n_prototypes, self.d_model)
        self._views: dict[int, nn.Module] = {}  # plain dict: views share the backbone's modules, not registered
        self.post_init()
        if getattr(backbone, "generation_config", None) is not None:  # the backbone's own decoding defaults
            self.generation_config = copy.deepcopy(backbone.generation_config)

    @classmethod
    def from_backbone(cls, backbone: PreTrainedModel, config: PrismConfig | None = None) -> PrismForCausalLM:
        """Wrap a transformers causal LM instance. The prototypes start random; prism.train initialises them
        from real token states (init_prototypes)."""
        if not isinstance(backbone, PreTrainedModel):
            raise TypeError(f"backbone must be a transformers PreTrainedModel, got {type(backbone).__name__}")
        model = cls(copy.deepcopy(config) if config is not None else PrismConfig(), backbone=backbone)
        return model.to(backbone.device)

    def _init_weights(self, module: nn.Module) -> None:
        """Only the bank is PRISM's own; transformers initialises the backbone's modules with its own rules."""
        if isinstance(module, PrototypeBank):
            nn.init.normal_(module.weight, std=1 / math.sqrt(module.weight.shape[1]))

    def get_input_embeddings(self) -> nn.Module:
        return self.backbone.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.backbone.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Module:
        return self.backbone.get_output_embeddings()

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.backbone.set_output_embeddings(value)

    # -- properties of the backbone -------------------------------------------------------------------------

    @property
    def d_model(self) -> int:
        return self.lm_head.in_features

    @property
    def vocab_size(self) -> int:
        return self.lm_head.out_features

    @property
    def lm_head(self) -> nn.Linear:
        return self.backbone.get_output_embeddings()

    @property
    def base_model(self) -> nn.Module:
        return self.backbone.base_model

    @property
    def n_layers(self) -> int:
        return self.backbone.config.num_hidden_layers

    @property
    def max_length(self) -> int | None:
        """The longest context the backbone accepts, when its config says."""
        for name in ("max_position_embeddings", "n_positions"):
            value = getattr(self.backbone.config, name, None)
            if value:
                return int(value)
        return None

    def decoder_layers(self) -> nn.ModuleList:
        return _decoder_layers(self.base_model, self.n_layers)[1]

    # -- the backbone's final states ------------------------------------------------------------------------

    def _check_input_ids(self, input_ids: torch.Tensor) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids must be a (batch, length) tensor, got {shape}")
        if input_ids.dtype not in (torch.long, torch.int32, torch.int64):
            raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        if input_ids.numel() and (input_ids.min() < 0 or input_ids.max() >= self.backbone.config.vocab_size):
            raise ValueError(f"input_ids must lie in [0, {self.backbone.config.vocab_size}), got values in "
                             f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids is empty: give at least one token")

    def final_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: object | None = None,
        use_cache: bool = False,
        start_layer: int | None = None,
        start_states: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, object | None]:
        """z (B, T, d), the backbone's final hidden state (after its final norm), and its KV cache.

        With start_layer/start_states, the layers below start_layer are skipped and start_states (B, T, d), the
        input of layer start_layer as returned by states_before_layer, is fed to it instead: training the top
        layers then costs only the top layers.
        """
        kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      cache=cache, use_cache=use_cache)
        if start_states is None:
            out = self.base_model(**kwargs)
            return out.last_hidden_state, getattr(out, "cache", None)
        if use_cache:
            raise ValueError("a top-layer view does not keep a KV cache")
        view = self._top_view(start_layer)
        first = view.__dict__["_first"]
        first.states = start_states
        try:
            out = view(**kwargs)
        finally:
            first.states = None
        return out.last_hidden_state, None

    @torch.no_grad()
    def states_before_layer(
        self, input_ids: torch.Tensor, layer: int, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The hidden states entering decoder layer `layer` (0-based), (B, T, d). Layers from `layer` up are not
        run. These are what a top-N training run caches once (layer = n_layers - N). Other threads running the
        model meanwhile (the app's other users) pass the hook by."""
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer must be in [0, {self.n_layers}), got {layer}")
        captured: dict[str, torch.Tensor] = {}
        owner = threading.get_ident()

        def grab(module, args, kwargs):
            if threading.get_ident() != owner:
                return None
            captured["states"] = args[0] if args else kwargs["hidden_states"]
            raise _StopForward

        handle = self.decoder_layers()[layer].register_forward_pre_hook(grab, with_kwargs=True)
        try:
            self.base_model(input_ids=input_ids, attention_mask=attention_mask)
        except _StopForward:
            pass
        finally:
            handle.remove()
        return captured["states"].detach()

    @contextlib.contextmanager
    def _states_entering(self, layer: int | None) -> Iterator[dict]:
        """While the block runs, the states entering decoder layer `layer` in this thread's forward passes go into
        the dict it yields ("states", detached; the last pass's); nothing is hooked with layer None. Registered
        around one pass at a time, so a generator resumed on another thread still sees its own."""
        captured: dict[str, torch.Tensor] = {}
        if layer is None:
            yield captured
            return
        owner = threading.get_ident()

        def grab(module, args, kwargs):
            if threading.get_ident() == owner:
                captured["states"] = (args[0] if args else kwargs["hidden_states"]).detach()

        handle = self.decoder_layers()[layer].register_forward_pre_hook(grab, with_kwargs=True)
        try:
            yield captured
        finally:
            handle.remove()

    def _top_view(self, start_layer: int | None) -> nn.Module:
        """A shallow copy of the base model whose layer list holds only layers start_layer.. (shared modules)."""
        if start_layer is None or not 0 <= start_layer < self.n_layers:
            raise ValueError(f"start_layer must be in [0, {self.n_layers}), got {start_layer}")
        if start_layer not in self._views:
            base = self.base_model
            name, layers = _decoder_layers(base, self.n_layers)
            first = _InjectedInput(layers[start_layer])
            view = copy.copy(base)
            view._modules = dict(base._modules)
            view._modules[name] = nn.ModuleList([first, *layers[start_layer + 1:]])
            view.__dict__["_first"] = first
            self._views[start_layer] = view
        return self._views[start_layer]

    # -- the prototype head ---------------------------------------------------------------------------------

    def head(
        self, z: torch.Tensor, interventions: Interventions | None = None, return_sims: bool = False
    ) -> PrismOutput:
        """Prototype activations, reconstruction and (intervened) logits for final states z (B, T, d)."""
        top = None
        if interventions is None or interventions.is_empty:
            sims, ids, values = self.prototypes.route(z, self.config.top_k)  # (B, T, K), (B, T, k) twice
            acts, top = F.relu(values), values[..., 0]
        else:  # a re-routed selection is taken from these sims: they keep their gradient
            sims = self.prototypes.similarities(z)  # (B, T, K)
            ids, acts = self.prototypes.activate(sims, self.config.top_k)  # (B, T, k) each
        z_hat = self.prototypes.reconstruct(ids, acts)  # (B, T, d)
        residual = z - z_hat  # (B, T, d)
        used_ids = used_acts = None
        if interventions is None or interventions.is_empty:
            z_used = z
        else:
            selected = self.select(sims, interventions) if interventions.reroutes else (ids, acts)
            used_ids, used_acts = self.effective_activations(*selected, interventions)  # (B, T, k') each
            if interventions.reroutes:  # a new selection: rebuild z' = r + sum_j a'_j p_j
                z_used = residual + self.prototypes.reconstruct(used_ids, used_acts)
            else:  # the same selection: add only what changed, z' = z + sum_j (a'_j - a_j) p_j
                z_used = z + self._delta(ids, acts, used_ids, used_acts)
        return PrismOutput(logits=self.lm_head(z_used), prototype_ids=ids, activations=acts, residual=residual, z=z,
                           z_hat=z_hat, sims=sims if return_sims else None, top_similarity=top,
                           used_prototype_ids=used_ids, used_activations=used_acts)  # logits (B, T, V)

    def select(self, sims: torch.Tensor, interventions: Interventions | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k selection the logits start from. sims (..., K) -> ids, activations (..., k).

        The model's own top-k; with suppress_mode "reroute" the top-k of the similarities with the suppressed
        prototypes masked out, so the nearest prototypes outside the set take their slots."""
        if interventions is None or not interventions.reroutes:
            return self.prototypes.activate(sims, self.config.top_k)
        interventions.check(self.config.n_prototypes)
        masked = sims.clone()
        masked[..., sorted(interventions.suppress)] = -math.inf
        # With fewer than k prototypes outside the set, masked entries fill the rest at activation ReLU(-inf) = 0.
        return self.prototypes.activate(masked, self.config.top_k)

    def effective_activations(
        self, ids: torch.Tensor, acts: torch.Tensor, interventions: Interventions | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The activations the logits actually use for a selection (ids, acts (..., k) from select(): the model's
        own top-k, or the re-routed one): (..., k + n_inject) ids and activations, where the controller (if any)
        has reweighted the selection first, then suppressed entries are 0, scaled ones multiplied, and injected
        prototypes set (their own top-k entry zeroed)."""
        if interventions is None or interventions.is_empty:
            return ids, acts
        interventions.check(self.config.n_prototypes)
        if interventions.controller is not None:
            new = interventions.controller.reweight(ids, acts)  # (..., k)
            if new.shape != acts.shape or bool((new < 0).any()):
                raise ValueError("the controller must return one activation >= 0 per active prototype")
        else:
            new = acts.clone()
        if interventions.suppress:
            suppressed = torch.tensor(sorted(interventions.suppress), device=ids.device)
            new = torch.where(torch.isin(ids, suppressed), torch.zeros_like(new), new)
        for i, factor in interventions.scale.items():
            new = torch.where(ids == i, new * factor, new)
        if not interventions.inject:
            return ids, new
        inject_ids = torch.tensor(list(interventions.inject), device=ids.device)  # (n,)
        inject_acts = torch.tensor(list(interventions.inject.values()), dtype=acts.dtype, device=ids.device)
        new = torch.where(torch.isin(ids, inject_ids), torch.zeros_like(new), new)
        lead = ids.shape[:-1]
        return (torch.cat([ids, inject_ids.expand(*lead, -1)], dim=-1),
                torch.cat([new, inject_acts.expand(*lead, -1)], dim=-1))

    def _delta(self, ids: torch.Tensor, acts: torch.Tensor, new_ids: torch.Tensor, new_acts: torch.Tensor,
               ) -> torch.Tensor:
        """z' - z when the selection is kept: sum_j (a'_j - a_j) p_j over old and injected entries. (..., d)"""
        k = ids.shape[-1]
        delta = self.prototypes.reconstruct(ids, new_acts[..., :k] - acts)
        if new_ids.shape[-1] > k:
            delta = delta + self.prototypes.reconstruct(new_ids[..., k:], new_acts[..., k:])
        return delta

    # -- forward --------------------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        interventions: Interventions | None = None,
        position_ids: torch.Tensor | None = None,
        cache: object | None = None,
        use_cache: bool | None = None,
        start_layer: int | None = None,
        start_states: torch.Tensor | None = None,
        return_sims: bool = False,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> PrismOutput:
        """input_ids (B, T) -> PrismOutput. labels (B, T) as input_ids (shifted inside; -100 is ignored).

        interventions apply to every position computed, so transformers' generate, which passes its extra keyword
        arguments to every step, applies them at every generated token. logits_to_keep=n > 0 runs the prototype head
        on the last n positions only (generate asks for 1); it is ignored when labels are given. Other transformers
        keyword arguments (return_dict, output_attentions, ...) are accepted and not used: hidden states and
        attentions are not returned (out.z is the final state).
        """
        self._check_input_ids(input_ids)
        if interventions is not None:
            interventions.check(self.config.n_prototypes)
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} must equal input_ids shape {tuple(input_ids.shape)}")
        z, cache = self.final_states(input_ids, attention_mask, position_ids, cache, bool(use_cache),
                                     start_layer, start_states)  # (B, T, d)
        if logits_to_keep and labels is None:
            z = z[:, -logits_to_keep:]  # (B, n, d)
        out = self.head(z, interventions, return_sims=return_sims or labels is not None)
        out.cache = cache
        if labels is not None:
            if attention_mask is not None:
                labels = labels.masked_fill(attention_mask == 0, -100)
            out.loss, out.losses = self.objective(out, labels)
            if not return_sims:
                out.sims = None
        return out

    def objective(self, out: PrismOutput, labels: torch.Tensor, path_logits: torch.Tensor | None = None,
                  gram: torch.Tensor | None = None, path_dtype: torch.dtype | None = None,
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """prism_loss of a head output (computed with return_sims=True) with this config's weights, in float32.
        The path terms run chunk by chunk through the LM head (losses.path_terms, its products in path_dtype:
        training passes bfloat16 under autocast) unless path_logits = lm_head(z_hat) are given whole; gram =
        head_gram(W) is computed here when its weight needs it and it is not given (training computes it once for
        a frozen head)."""
        cfg = self.config
        if cfg.lambda_head_rec and gram is None:
            gram = head_gram(self.lm_head.weight)  # (d, d)
        routed = out.top_similarity is not None  # R1, R2 without a gradient through sims (coverage_losses)
        return prism_loss(out.logits.float(), labels, out.z.float(), out.z_hat.float(),
                          out.sims if routed else out.sims.float(), cfg.lambda_rec, cfg.lambda_r1, cfg.lambda_r2,
                          top_similarity=out.top_similarity if routed else None,
                          prototypes=self.prototypes.weight if routed else None,
                          path_logits=None if path_logits is None else path_logits.float(),
                          path_head=(self.lm_head.weight, self.lm_head.bias), path_dtype=path_dtype,
                          lambda_path_ce=cfg.lambda_path_ce, lambda_path_kl=cfg.lambda_path_kl,
                          gram=gram, lambda_head_rec=cfg.lambda_head_rec)

    # -- decomposition --------------------------------------------------------------------------------------

    @torch.no_grad()
    def decompose(
        self,
        input_ids: torch.Tensor,
        position: int = -1,
        token_id: int | None = None,
        interventions: Interventions | None = None,
    ) -> Decomposition:
        """Split the logit of token_id at `position` into residual + one contribution per active prototype.

        input_ids (1, T) or (T,); token_id None means the argmax token at that position (after interventions).
        """
        if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        self._check_input_ids(input_ids)
        if input_ids.shape[0] != 1:
            raise ValueError(f"decompose takes one sequence, got a batch of {input_ids.shape[0]}")
        length = input_ids.shape[1]
        if not -length <= position < length:
            raise ValueError(f"position {position} is outside a sequence of {length} tokens")
        out = self(input_ids, interventions=interventions)
        return self.decompose_output(out, position, token_id)[0]

    def decompose_output(
        self,
        out: PrismOutput,
        position: int,
        token_ids: int | list[int] | None = None,
    ) -> list[Decomposition]:
        """Decompose several tokens' logits at one position of a forward output (batch row 0) without rerunning
        the model; token_ids None means the argmax token. The slices are those of the prototypes the logits used
        (out.used_* when the forward had interventions), so they add up to out.logits in every mode."""
        length = out.logits.shape[1]
        position = position % length
        logits = out.logits[0, position]  # (V,)
        if token_ids is None:
            token_ids = [int(logits.argmax())]
        elif isinstance(token_ids, int):
            token_ids = [token_ids]
        for t in token_ids:
            if not 0 <= int(t) < logits.shape[0]:
                raise ValueError(f"token_id {t} is outside the vocabulary of {logits.shape[0]} tokens")
        own_ids, own_acts = out.prototype_ids[0, position], out.activations[0, position]  # (k,)
        if out.used_prototype_ids is None:
            ids, acts = own_ids, own_acts
        else:
            ids, acts = out.used_prototype_ids[0, position], out.used_activations[0, position]  # (k',)
        removed, rerouted = changed_selection(own_ids, own_acts, ids, acts)
        keep = acts > 0
        ids, acts = ids[keep], acts[keep]
        order = acts.argsort(descending=True)
        ids, acts = ids[order], acts[order]
        rows = self.lm_head.weight[torch.tensor([int(t) for t in token_ids])]  # (n, d)
        bias = self.lm_head.bias
        signatures = rows @ self.prototypes.weight[ids].T  # (n, k'): (W p_i)[v]
        contributions = signatures * acts  # (n, k')
        residual = rows @ out.residual[0, position]  # (n,)
        if bias is not None:
            residual = residual + bias[torch.tensor([int(t) for t in token_ids])]
        return [
            Decomposition(
                token_id=int(t), position=position, logit=float(logits[int(t)]), residual=float(residual[n]),
                prototype_ids=[int(i) for i in ids], activations=[float(a) for a in acts],
                contributions=[float(c) for c in contributions[n]], removed_ids=removed, rerouted_ids=rerouted,
            )
            for n, t in enumerate(token_ids)
        ]

    # -- generation -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def stream(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 20,
        interventions: Interventions | None = None,
        attention_mask: torch.Tensor | None = None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        eos_token_id: int | None = None,
        top_k: int = 0,
        keep_states_before: int | None = None,
    ) -> Iterator[GenerationStep]:
        """Generate token by token with the backbone's KV cache, yielding each step (the app's explain-while-
        generating loop; generate() is transformers' and runs the same forward).

        Interventions change the logits of every generated position; sampling uses a generator seeded per call
        (seed), never the global RNG, so the same seed gives the same sample with or without interventions
        wherever the distributions agree. It filters and draws as transformers does, so
        generate(..., do_sample=True, seed=s) picks the same tokens. Sequences that produced eos_token_id keep
        producing it. keep_states_before=L: each step also returns the states entering decoder layer L at the
        positions its forward read (GenerationStep.layer_states; states_before_layer's, from the KV-cached passes).
        """
        self._check_input_ids(input_ids)
        if keep_states_before is not None and not 0 <= keep_states_before < self.n_layers:
            raise ValueError(f"keep_states_before must be in [0, {self.n_layers}), got {keep_states_before}")
        if interventions is not None:
            interventions.check(self.config.n_prototypes)
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if do_sample and not (temperature > 0 and 0 < top_p <= 1 and top_k >= 0):
            raise ValueError(f"sampling needs temperature > 0, 0 < top_p <= 1 and top_k >= 0, got {temperature}, "
                             f"{top_p}, {top_k}")
        generator = torch.Generator(device=input_ids.device)
        generator.manual_seed(0 if seed is None else int(seed))
        batch = input_ids.shape[0]
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)  # (B, T), left padding aware
        finished = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
        step_ids, cache = input_ids, None
        for step in range(max_new_tokens):
            with self._states_entering(keep_states_before) as kept:
                out = self(step_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                           use_cache=True, interventions=interventions, logits_to_keep=1)
            cache = out.cache
            logits = out.logits[:, -1].float()  # (B, V)
            if do_sample:
                next_ids = _sample(logits, temperature, top_k, top_p, generator)
            else:
                next_ids = logits.argmax(-1)
            if eos_token_id is not None:
                next_ids = torch.where(finished, torch.full_like(next_ids, eos_token_id), next_ids)
                finished |= next_ids == eos_token_id
            used = (None, None) if out.used_prototype_ids is None else \
                (out.used_prototype_ids[:, -1], out.used_activations[:, -1])
            yield GenerationStep(step=step, token_ids=next_ids, prototype_ids=out.prototype_ids[:, -1],
                                 activations=out.activations[:, -1], logits=logits, used_prototype_ids=used[0],
                                 used_activations=used[1], state=out.z[:, -1], layer_states=kept.get("states"))
            if eos_token_id is not None and bool(finished.all()):
                return
            step_ids = next_ids[:, None]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], dim=1)
            position_ids = position_ids[:, -1:] + 1

    def generate(self, inputs: torch.Tensor | None = None, generation_config: GenerationConfig | None = None,
                 *args, seed: int | None = None, **kwargs):
        """transformers' generate (every decoding option, LogitsProcessor, StoppingCriteria, streamer, ...), plus:

        interventions=Interventions(...): applied at every step, in every decoding mode (it is passed to forward).
        top_k: off unless given (or set in the generation config), as in stream().
        seed: sampling draws from the global RNG seeded with `seed` for this call only (the caller's RNG state is
        restored afterwards), so generate(..., do_sample=True, seed=s) picks what stream(..., seed=s) picks.
        generate(ids, 20) keeps the older positional max_new_tokens.
        """
        if isinstance(generation_config, int) and not isinstance(generation_config, bool):
            kwargs["max_new_tokens"], generation_config = generation_config, None
        sampling = kwargs.get("do_sample", (generation_config or self.generation_config).do_sample)
        if sampling and "top_k" not in kwargs and (generation_config or self.generation_config).top_k is None:
            # Sampling is temperature and top-p unless top_k is asked for, as in stream(); transformers' own
            # default would add top-k 50. top_k=0 switches that filter off.
            kwargs["top_k"] = 0
        if seed is None:
            return super().generate(inputs, generation_config, *args, **kwargs)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type if devices else "cuda"):
            torch.manual_seed(int(seed))
            return super().generate(inputs, generation_config, *args, **kwargs)

    # -- checkpoints ----------------------------------------------------------------------------------------

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.named_parameters() if p.requires_grad}

    def backbone_fingerprint(self, exclude: set[str] = frozenset()) -> str:
        """sha256 over the backbone tensors not in `exclude` (names as in this model's state dict)."""
        digest = hashlib.sha256()
        for name, tensor in sorted(self.state_dict().items()):
            if name.startswith("backbone.") and name not in exclude:
                digest.update(name.encode())
                digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        return digest.hexdigest()

    def save_pretrained(self, save_directory: str | Path, trainable_only: bool = False, **kwargs) -> None:
        """Write config.json, generation_config.json and model.safetensors to the folder `save_directory`.

        trainable_only=True writes only the parameters that require grad (e.g. the top layers and the bank) plus
        a fingerprint of the rest; loading then rebuilds the backbone from config.backbone. Otherwise this is
        transformers' save_pretrained (every tensor, tied ones once; its keyword arguments apply).
        """
        path = Path(save_directory)
        if not trainable_only:
            self.config.weights = "full"
            super().save_pretrained(path, **kwargs)
            return
        if self.config.backbone is None:
            raise ValueError("trainable_only needs config.backbone (where the frozen backbone comes from)")
        path.mkdir(parents=True, exist_ok=True)
        # The tensors may live on a GPU: safetensors and the fingerprint read them from CPU copies.
        state = {n: t.detach().to("cpu").contiguous().clone() for n, t in self.trainable_state_dict().items()}
        config = copy.deepcopy(self.config)
        config.weights = "trainable"
        config.backbone_fingerprint = self.backbone_fingerprint(exclude=set(state))
        config.architectures = [type(self).__name__]
        save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
        config.save_pretrained(path)
        if self.generation_config is not None:
            self.generation_config.save_pretrained(path)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | Path, *model_args,
                        backbone: PreTrainedModel | None = None, **kwargs) -> PrismForCausalLM:
        """Load a folder written by save_pretrained (safetensors only, no pickle); AutoModelForCausalLM lands here.

        A trainable-only checkpoint rebuilds its backbone from config.backbone (or takes `backbone`) and checks it
        against the stored fingerprint; a full one goes through transformers' loader with its usual keyword
        arguments (dtype, device_map, ...). Folders of the older PRISM format (no model_type) still load.
        """
        path = Path(pretrained_model_name_or_path)
        local = path.exists() or path.is_absolute() or str(pretrained_model_name_or_path).startswith(".")
        if not local:  # a hub id: a full checkpoint is transformers' business, a trainable-only one is fetched
            path = _fetch_trainable(str(pretrained_model_name_or_path), kwargs)
            if path is None:
                return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        config_file, weights_file = path / CONFIG_NAME, path / WEIGHTS_NAME
        if not config_file.is_file() or not weights_file.is_file():
            raise FileNotFoundError(f"{path} is not a PRISM checkpoint: expected {CONFIG_NAME} and {WEIGHTS_NAME}")
        config = kwargs.pop("config", None)
        if not isinstance(config, PrismConfig):
            try:
                config = PrismConfig.from_dict(upgrade_config(json.loads(config_file.read_text())))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
                raise ValueError(f"{config_file} is not a valid PRISM config: {err}") from err
        if config.weights == "full" and backbone is None:
            try:
                return super().from_pretrained(path, *model_args, config=config, **kwargs)
            except (SafetensorError, OSError, RuntimeError) as err:
                raise ValueError(f"{weights_file} is corrupt or does not match its config: {err}") from err
        return cls._from_trainable(path, config, backbone, kwargs)

    @classmethod
    def _from_trainable(cls, path: Path, config: PrismConfig, backbone: PreTrainedModel | None,
                        kwargs: dict) -> PrismForCausalLM:
        """A trainable-only (or given-backbone) checkpoint: backbone from its spec, then the saved tensors."""
        if backbone is None:
            from prism.backbones import load_backbone

            backbone = load_backbone(config.backbone)
        model = cls(config, backbone=backbone)
        try:
            state = load_file(str(path / WEIGHTS_NAME))
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{path / WEIGHTS_NAME} is corrupt: {err}") from err
        own = model.state_dict()
        unexpected = sorted(set(state) - set(own))
        if unexpected:
            raise ValueError(f"{path / WEIGHTS_NAME} holds tensors this backbone lacks: {unexpected[:5]}")
        if config.weights == "trainable":
            fingerprint = model.backbone_fingerprint(exclude=set(state))
            if config.backbone_fingerprint and fingerprint != config.backbone_fingerprint:
                raise ValueError(f"the backbone {config.backbone!r} differs from the one {path} was trained on "
                                 "(fingerprint mismatch); install the exact backbone version it names")
        else:
            missing = sorted(set(own) - set(state) - set(model.all_tied_weights_keys))
            if missing:
                raise ValueError(f"{path / WEIGHTS_NAME} does not match its config: missing {missing[:5]}")
        for name, tensor in state.items():
            if own[name].shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(own[name].shape)}")
        model.load_state_dict(state, strict=False)
        if (path / GENERATION_CONFIG_NAME).is_file():
            model.generation_config = GenerationConfig.from_pretrained(path)
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        if isinstance(dtype, str) and dtype != "auto":
            dtype = getattr(torch, dtype)
        if isinstance(dtype, torch.dtype):
            model = model.to(dtype)
        device_map = kwargs.get("device_map")
        if isinstance(device_map, (str, torch.device, int)) and device_map != "auto":
            model = model.to(device_map)
        return model.eval()


def _fetch_trainable(repo_id: str, kwargs: dict) -> Path | None:
    """The local (cached) folder of a trainable-only checkpoint on the hub, or None for a full one, which
    transformers' loader downloads itself (shards included)."""
    from transformers.utils import cached_file

    hub = {k: kwargs[k] for k in ("revision", "token", "cache_dir", "local_files_only", "force_download")
           if k in kwargs}
    config_file = Path(cached_file(repo_id, CONFIG_NAME, **hub))
    if upgrade_config(json.loads(config_file.read_text())).get("weights") != "trainable":
        return None
    cached_file(repo_id, WEIGHTS_NAME, **hub)
    cached_file(repo_id, GENERATION_CONFIG_NAME, _raise_exceptions_for_missing_entries=False, **hub)
    return config_file.parent  # the snapshot folder holding all three


def upgrade_config(meta: dict) -> dict:
    """A config.json of the first PRISM format ({"format_version": 1, "weights", "prism", "backbone_config"}) as a
    PrismConfig dict; a current one is returned as it is."""
    if "model_type" in meta or "prism" not in meta:
        return meta
    return {**meta["prism"], "model_type": "prism", "weights": meta["weights"],
            "text_config": meta["backbone_config"], "architectures": ["PrismForCausalLM"]}


def _sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
            generator: torch.Generator) -> torch.Tensor:
    """Sampling from logits (B, V) -> (B,), filtered by transformers' own warpers in generate's order
    (temperature, top-k, top-p) so that a seeded stream() and a seeded generate() draw the same tokens."""
    if temperature != 1.0:
        logits = TemperatureLogitsWarper(temperature)(None, logits)
    if top_k:
        logits = TopKLogitsWarper(top_k)(None, logits)
    if top_p < 1.0:
        logits = TopPLogitsWarper(top_p)(None, logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
