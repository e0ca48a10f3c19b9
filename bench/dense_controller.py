"""The dense baseline of the controller experiment (bench/controllers.py): a controller with as many parameters as a
prototype controller, the same parametrisation, regulariser and fit, but no prototypes.

z is written in a fixed random Parseval frame F (K, d) (orthonormal columns, so F^T F z = z when K >= d) and the K
frame coefficients are reweighted, z' = z + F^T ((exp(g) - 1) * F z). It is the dense analogue of the prototype
controller (prism/controllers.py): a reweighting of the coefficients of an exact decomposition of z, dense instead
of sparse and data-anchored. It edits the hidden state, so it is not an Interventions value: it is applied as
lm_head(edit(z)) and only the experiment uses it.

    fitted = fit_best(DENSE, model, feats["fit"], feats["val"], FitArgs(), seed=0)   # prism/controller_fit.py
    save_controller(fitted.controller, "dense-seed0.safetensors")
    controller = load_any("dense-seed0.safetensors", model)     # a DenseController or a PrototypeController
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from prism.controller_fit import CandidateFeatures, ControllerKind, candidate_logprobs
from prism.controllers import (
    PrototypeController,
    check_controller,
    check_log_factors,
    load_controller,
    read_controller_file,
)
from prism.model import PrismForCausalLM


@dataclass(frozen=True, eq=False)
class DenseController:
    """The baseline: z' = z + F^T ((exp(g) - 1) * F z) with a fixed frame F (K, d) and log_factors g (K,)."""

    frame: torch.Tensor  # (K, d)
    log_factors: torch.Tensor  # (K,)
    meta: dict = field(default_factory=dict)

    kind = "dense"

    def __post_init__(self) -> None:
        check_log_factors(self.log_factors)
        if self.frame.dim() != 2 or self.frame.shape[0] != self.log_factors.shape[0]:
            raise ValueError(f"frame must be (K, d) with K = {self.log_factors.shape[0]}, got "
                             f"{tuple(self.frame.shape)}")

    def __repr__(self) -> str:
        return (f"DenseController(task={self.meta.get('task')!r}, seed={self.meta.get('seed')!r}, "
                f"K={self.n_prototypes}, d={self.frame.shape[1]}, moved={len(self.moved())})")

    @property
    def n_prototypes(self) -> int:  # its K: the same parameter count as a prototype controller of this model
        return int(self.log_factors.shape[0])

    @property
    def n_parameters(self) -> int:
        return self.n_prototypes

    def delta(self, z: torch.Tensor) -> torch.Tensor:
        """z (..., d) -> z' - z (..., d)."""
        change = self.log_factors.exp() - 1  # (K,)
        n_states, d = z[..., 0].numel(), z.shape[-1]
        if n_states > d:  # many states (fitting): form the (d, d) map F^T diag(change) F once
            return z @ ((self.frame.T * change) @ self.frame)
        return ((z @ self.frame.T) * change) @ self.frame  # (..., K) coefficients, reweighted, back to (..., d)

    def edit(self, z: torch.Tensor) -> torch.Tensor:
        return z + self.delta(z)

    def moved(self) -> list[int]:
        return torch.nonzero(self.log_factors).flatten().tolist()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"log_factors": self.log_factors.detach().float().contiguous(),
                "frame": self.frame.detach().float().contiguous()}


def make_frame(n_features: int, d_model: int, seed: int) -> torch.Tensor:
    """A fixed random Parseval frame (K, d): orthonormal columns when K >= d (F^T F = I), rows otherwise."""
    g = torch.Generator().manual_seed(seed)
    gaussian = torch.randn(max(n_features, d_model), min(n_features, d_model), generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)  # (max, min) with orthonormal columns
    q = q * torch.sign(torch.diagonal(r))  # a unique QR, so the frame depends only on the seed
    return (q if n_features >= d_model else q.T).float().contiguous()


class GatheredRowsDot(torch.autograd.Function):
    """out[n, m] = W[idx[n, m]] . x[n] without keeping the gathered (N, M, d) rows for backward (they are
    gathered again there, in chunks), so a dense z edit can be fitted in bounded memory."""

    CHUNK = 128  # (128, M + 1, d) gathered rows at a time

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight, idx)
        out = torch.empty(idx.shape, dtype=x.dtype)
        for lo in range(0, x.shape[0], GatheredRowsDot.CHUNK):
            sl = slice(lo, lo + GatheredRowsDot.CHUNK)
            out[sl] = torch.einsum("nmd,nd->nm", weight[idx[sl]], x[sl])
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight, idx = ctx.saved_tensors
        grad_x = torch.empty(idx.shape[0], weight.shape[1], dtype=grad.dtype)
        for lo in range(0, idx.shape[0], GatheredRowsDot.CHUNK):
            sl = slice(lo, lo + GatheredRowsDot.CHUNK)
            grad_x[sl] = torch.einsum("nm,nmd->nd", grad[sl], weight[idx[sl]])
        return grad_x, None, None


def _dense_logprobs(log_factors: torch.Tensor, feats: CandidateFeatures, positions: torch.Tensor,
                    model: PrismForCausalLM, frame: torch.Tensor) -> torch.Tensor:
    """The fit's log p(target) at positions (P,) under the baseline's log_factors (K,) and frame (K, d)."""
    dz = DenseController(frame, log_factors).delta(feats.enc.z[positions])  # (P, d)
    d_cand = GatheredRowsDot.apply(dz, model.lm_head.weight.detach(), feats.candidates[positions])  # (P, M + 1)
    d_tail = (feats.m_tail[positions] * dz).sum(-1)  # (P,)
    return candidate_logprobs(feats, positions, d_cand, d_tail)


DENSE = ControllerKind("dense", _dense_logprobs,
                       build=lambda g, frame, description: DenseController(frame, g, description),
                       fixed=lambda model, seed: make_frame(model.config.n_prototypes, model.d_model, seed))


def load_any(path: str | Path, model: PrismForCausalLM | None = None) -> PrototypeController | DenseController:
    """A controller file of either kind; with a model, refuse one fitted for another model."""
    kind, tensors, description = read_controller_file(path)
    if kind != DENSE.name:
        return load_controller(path, model)
    controller = DenseController(tensors["frame"], tensors["log_factors"], description)
    if model is not None:
        check_controller(controller, model, str(path))
        if controller.frame.shape[1] != model.d_model:
            raise ValueError(f"{path} edits states of size {controller.frame.shape[1]}, this model's are "
                             f"{model.d_model}")
    return controller
