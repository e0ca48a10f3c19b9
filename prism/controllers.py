"""Prototype controllers: a fitted, sparse reweighting of the active prototypes, and its dense baseline.

PRISM.md section 3 (controllers): at every position the model's own active prototypes keep their ids and their
activations are multiplied by fitted per-prototype factors,

    a'_{t,i} = exp(g_i) * a_{t,i}   for i in K_t,   so   l'_t = l_t + sum_{i in K_t} (exp(g_i) - 1) a_{t,i} W p_i

a linear (diagonal) map of the active-prototype vector with K parameters g, most of them exactly 0 (factor 1):
the fit applies a soft threshold (L1, proximal step) after every Adam step and can cap the number of moved
prototypes (top-m). Activations stay >= 0 and every change of a logit is a sum of named prototypes' slices, so each
correction points at the prototypes it moved and, through their evidence, at their training neighbourhoods.
A full K x K map would have K^2 parameters for a few hundred labelled items and no longer one number per
prototype. The controller is applied as `Interventions(controller=...)`, so head, forward, decompose, stream and
generate (and the app) use it like suppression and steering.

The baseline (DenseController) has the same K parameters, the same parametrisation, regulariser and fit, but no
prototypes: z is written in a fixed random Parseval frame F (K, d) (orthonormal columns, so F^T F z = z when
K >= d) and the K frame coefficients are reweighted, z' = z + F^T ((exp(g) - 1) * F z). It is the dense analogue of
the prototype controller: a reweighting of the coefficients of an exact decomposition of z, dense instead of
sparse and data-anchored.

Both are fitted on multiple-choice items (prism/multiple_choice.py): the score of an option is its mean token
log-probability, the loss the cross-entropy of the right option over the options' scores / temperature. The
backbone is frozen, so the items' final states are computed once and the fit only replays the head. Hyper-parameter
choice (L1 strength, epoch, identity included) is by validation accuracy; test accuracy is exact, through
model.head with Interventions (or lm_head of the edited z for the baseline).

The fit's softmax per position covers the target, the `candidates` most likely other tokens and the rest of the
vocabulary as one first-order term (CandidateFeatures in prism/multiple_choice.py): exact when nothing moves and
far cheaper than the full vocabulary on a CPU. Seeds change the item order (and the baseline's frame); eval reports
the mean and spread over seeds and, per seed, the items fixed and broken against the plain model on the same items.

    python -m prism.controllers fit --checkpoint runs/prism/final --tasks runs/prism/tasks --out runs/prism/ctl
    python -m prism.controllers eval --out runs/prism/ctl          # per-task accuracies as JSON

On a CPU that another job keeps busy, OMP_NUM_THREADS=1 avoids threads waiting on each other.

Tasks come from `python -m precompute.controllers build`; `python -m precompute.controllers describe` labels the
moved prototypes from a precompute database.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from prism.model import Interventions, PrismForCausalLM
from prism.multiple_choice import (
    REDUCTIONS,
    CandidateFeatures,
    EncodedItems,
    GatheredRowsDot,
    accuracy,
    candidate_features,
    candidate_logprobs,
    correct,
    encode_items,
    exact_logprobs,
    option_scores,
    read_items,
    tokenize_items,
)

logger = logging.getLogger(__name__)

KINDS = ("prototype", "dense")
FORMAT_VERSION = 1
METADATA_KEY = "prism_controller"
FIT_ARGS = "fit_args.json"
FIT_SUMMARY = "fit.json"
EVAL_RESULTS = "eval.json"
CACHE_DIR = "cache"
COST_PROMPT = "The history of the river begins"  # what eval times generation on


# ----------------------------------------------------------------------------------------------------------------
# The controllers.


@dataclass(frozen=True, eq=False)
class PrototypeController:
    """Per-prototype factors exp(g) on the active activations. log_factors (K,); 0 means untouched."""

    log_factors: torch.Tensor  # (K,)
    meta: dict = field(default_factory=dict)  # what it was fitted on and how (saved with it)

    kind = "prototype"

    def __post_init__(self) -> None:
        _check_log_factors(self.log_factors)

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


@dataclass(frozen=True, eq=False)
class DenseController:
    """The baseline: z' = z + F^T ((exp(g) - 1) * F z) with a fixed frame F (K, d) and log_factors g (K,)."""

    frame: torch.Tensor  # (K, d)
    log_factors: torch.Tensor  # (K,)
    meta: dict = field(default_factory=dict)

    kind = "dense"

    def __post_init__(self) -> None:
        _check_log_factors(self.log_factors)
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


def _check_log_factors(g: torch.Tensor) -> None:
    if not isinstance(g, torch.Tensor) or g.dim() != 1 or g.shape[0] == 0:
        raise ValueError("log_factors must be a non-empty 1-d tensor (one entry per prototype)")
    if not bool(torch.isfinite(g).all()):
        raise ValueError("log_factors must be finite (factors exp(g) stay > 0, activations >= 0)")


def make_frame(n_features: int, d_model: int, seed: int) -> torch.Tensor:
    """A fixed random Parseval frame (K, d): orthonormal columns when K >= d (F^T F = I), rows otherwise."""
    g = torch.Generator().manual_seed(seed)
    gaussian = torch.randn(max(n_features, d_model), min(n_features, d_model), generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)  # (max, min) with orthonormal columns
    q = q * torch.sign(torch.diagonal(r))  # a unique QR, so the frame depends only on the seed
    return (q if n_features >= d_model else q.T).float().contiguous()


Controller = PrototypeController | DenseController


# ----------------------------------------------------------------------------------------------------------------
# Files: one safetensors file per controller, its description as JSON in the header.


def bank_fingerprint(model: PrismForCausalLM) -> str:
    """sha256 of the prototype bank: every trained checkpoint has its own."""
    digest = hashlib.sha256()
    digest.update(json.dumps([model.config.n_prototypes, model.d_model, model.vocab_size]).encode())
    digest.update(model.prototypes.weight.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def save_controller(controller: Controller, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"log_factors": controller.log_factors.detach().float().contiguous()}
    if isinstance(controller, DenseController):
        tensors["frame"] = controller.frame.detach().float().contiguous()
    meta = {"format_version": FORMAT_VERSION, "kind": controller.kind, "n_prototypes": controller.n_prototypes,
            "n_moved": len(controller.moved()), **controller.meta}
    tmp = path.with_name(path.name + ".partial")
    save_file(tensors, str(tmp), metadata={METADATA_KEY: json.dumps(meta, default=str)})
    tmp.replace(path)
    return path


def load_controller(path: str | Path, model: PrismForCausalLM | None = None) -> Controller:
    """Read a controller file; with a model, refuse one fitted for another model (clear ValueError)."""
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
    known = {"kind", "format_version", "n_prototypes", "n_moved"}
    description = {k: v for k, v in meta.items() if k not in known}
    if kind == "prototype":
        controller: Controller = PrototypeController(tensors["log_factors"], description)
    elif kind == "dense":
        controller = DenseController(tensors["frame"], tensors["log_factors"], description)
    else:
        raise ValueError(f"{path}: unknown controller kind {kind!r} (one of {', '.join(KINDS)})")
    if model is not None:
        check_controller(controller, model, str(path))
    return controller


def check_controller(controller: Controller, model: PrismForCausalLM, name: str = "the controller") -> None:
    if controller.n_prototypes != model.config.n_prototypes:
        raise ValueError(f"{name} was fitted for a model with {controller.n_prototypes} prototypes but this model "
                         f"has {model.config.n_prototypes}: it belongs to another model")
    if isinstance(controller, DenseController) and controller.frame.shape[1] != model.d_model:
        raise ValueError(f"{name} edits states of size {controller.frame.shape[1]}, this model's are {model.d_model}")
    expected = controller.meta.get("bank_fingerprint")
    if expected and expected != bank_fingerprint(model):
        raise ValueError(f"{name} was fitted on another checkpoint (prototype bank fingerprint mismatch): fit it "
                         "again for this model")


# ----------------------------------------------------------------------------------------------------------------
# Fitting.


@dataclass
class FitArgs:
    epochs: int = 8  # passes over the fit items; the best epoch on validation is kept
    lr: float = 0.05  # Adam step size on g = log(factor)
    batch_size: int = 16  # items per step
    # Soft threshold lr * l1 on g after every Adam step, one fit per value. Adam moves g by about lr per step
    # where its gradient keeps its sign, so a prototype keeps a factor != 1 only where its normalised gradient
    # is consistently above l1: values in (0, 1) span dense to empty.
    l1: tuple[float, ...] = (0.1, 0.4)
    max_moved: int | None = None  # top-m: at most this many prototypes (features) move; None = no cap
    max_factor: float = 10.0  # factors stay in [1 / max_factor, max_factor]
    temperature: float = 0.1  # option scores / temperature -> softmax over the options
    reduce: str = "mean"  # option score: mean (default) or sum of its token log-probabilities
    candidates: int = 32  # tokens per position in the fit's softmax, beside the target (the rest: one term)

    def __post_init__(self) -> None:
        self.l1 = tuple(float(v) for v in self.l1)
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"reduce must be one of {REDUCTIONS}, got {self.reduce!r}")
        if self.epochs < 1 or self.batch_size < 1 or self.candidates < 1:
            raise ValueError("epochs, batch_size and candidates must be >= 1")
        if not (self.lr > 0 and self.temperature > 0 and self.max_factor > 1):
            raise ValueError("lr and temperature must be > 0 and max_factor > 1")
        if not self.l1 or any(v < 0 for v in self.l1):
            raise ValueError(f"l1 needs at least one value >= 0, got {self.l1}")
        if self.max_moved is not None and self.max_moved < 1:
            raise ValueError(f"max_moved must be >= 1 or None, got {self.max_moved}")


@dataclass
class StepOutput:
    loss: torch.Tensor
    losses: dict[str, float]
    metrics: dict[str, float]


@dataclass
class FitResult:
    controller: Controller
    l1: float
    epoch: int  # 0 = no epoch beat the identity on validation
    val_accuracy: float
    val_accuracy_before: float
    history: list[dict]


def _fit_logprobs(kind: str, log_factors: torch.Tensor, feats: CandidateFeatures, positions: torch.Tensor,
                  model: PrismForCausalLM, frame: torch.Tensor | None) -> torch.Tensor:
    """The fit's log p(target) at positions (P,) under controller parameters log_factors (K,)."""
    if kind == "prototype":
        ids, acts = feats.prototype_ids[positions], feats.activations[positions]  # (P, k)
        # the same reweighting head() applies, through the same Interventions path
        _, new = model.effective_activations(ids, acts, Interventions(controller=PrototypeController(log_factors)))
        change = new - acts  # (P, k)
        d_cand = torch.einsum("pmk,pk->pm", feats.cand_signatures[positions], change)  # (P, M + 1)
        d_tail = (feats.tail_signatures[positions] * change).sum(-1)  # (P,)
    else:
        dz = DenseController(frame, log_factors).delta(feats.enc.z[positions])  # (P, d)
        d_cand = GatheredRowsDot.apply(dz, model.lm_head.weight.detach(), feats.candidates[positions])
        d_tail = (feats.m_tail[positions] * dz).sum(-1)
    return candidate_logprobs(feats, positions, d_cand, d_tail)


def batch_scores(enc: EncodedItems, items: torch.Tensor, logprobs: torch.Tensor, reduce: str) -> torch.Tensor:
    """Option scores (B, n_options) of the items (B,) from the log-probabilities of their positions (in the order
    enc.positions(items) gives)."""
    n_opt = enc.n_options
    rank = torch.full((enc.n_items,), -1, dtype=torch.long)
    rank[items] = torch.arange(items.shape[0])
    option = enc.position_option[enc.positions(items)]  # (P,) global option index
    local = rank[option // n_opt] * n_opt + option % n_opt
    total = torch.zeros(items.shape[0] * n_opt, dtype=logprobs.dtype).index_add(0, local, logprobs)
    if reduce == "mean":
        lengths = enc.option_length.view(-1, n_opt)[items].reshape(-1)
        total = total / lengths.to(logprobs.dtype)
    return total.view(-1, n_opt)


def fit_objective(kind: str, log_factors: torch.Tensor, feats: CandidateFeatures, items: torch.Tensor,
                  model: PrismForCausalLM, frame: torch.Tensor | None, args: FitArgs) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
    """Mean cross-entropy of the right option over items (B,), and the option scores (B, n_options)."""
    enc = feats.enc
    logprobs = _fit_logprobs(kind, log_factors, feats, enc.positions(items), model, frame)
    scores = batch_scores(enc, items, logprobs, args.reduce)
    loss = torch.nn.functional.cross_entropy(scores / args.temperature, enc.answers[items])
    return loss, scores


def _train_step(kind, log_factors, optimizer, feats, items, model, frame, args, l1) -> StepOutput:
    optimizer.zero_grad()
    loss, scores = fit_objective(kind, log_factors, feats, items, model, frame, args)
    loss.backward()
    optimizer.step()
    _project(log_factors, args, l1)
    return StepOutput(loss=loss.detach(), losses={"ce": float(loss.detach())},
                      metrics={"accuracy": accuracy(scores.detach(), feats.enc.answers[items]),
                               "moved": int((log_factors != 0).sum())})


@torch.no_grad()
def _project(g: torch.Tensor, args: FitArgs, l1: float) -> None:
    """Proximal L1 step (soft threshold lr * l1), the factor bounds, then the top-m cap."""
    g.copy_(g.sign() * (g.abs() - args.lr * l1).clamp_min(0))
    bound = math.log(args.max_factor)
    g.clamp_(-bound, bound)
    if args.max_moved is not None and int((g != 0).sum()) > args.max_moved:
        keep = g.abs().topk(args.max_moved).indices
        mask = torch.zeros_like(g, dtype=torch.bool)
        mask[keep] = True
        g.masked_fill_(~mask, 0.0)


@torch.no_grad()
def evaluate_fit(kind, log_factors, feats, model, frame, args, batch_size: int = 64) -> dict[str, float]:
    """Loss and accuracy of the fit objective on all items of feats (validation)."""
    losses, scores = [], []
    for lo in range(0, feats.enc.n_items, batch_size):
        items = torch.arange(lo, min(lo + batch_size, feats.enc.n_items))
        loss, s = fit_objective(kind, log_factors, feats, items, model, frame, args)
        losses.append(float(loss) * items.shape[0])
        scores.append(s)
    scores_all = torch.cat(scores)
    return {"loss": sum(losses) / feats.enc.n_items, "accuracy": accuracy(scores_all, feats.enc.answers)}


def fit_controller(kind: str, model: PrismForCausalLM, fit: CandidateFeatures, val: CandidateFeatures,
                   args: FitArgs, seed: int, l1: float, meta: dict | None = None) -> FitResult:
    """Fit one controller (one L1 strength, one seed); keep the epoch with the best validation accuracy (then
    loss), the identity (epoch 0) included."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    n = model.config.n_prototypes
    frame = make_frame(n, model.d_model, seed) if kind == "dense" else None
    g = torch.zeros(n, requires_grad=True)
    optimizer = torch.optim.Adam([g], lr=args.lr)
    order_rng = torch.Generator().manual_seed(seed)
    start = evaluate_fit(kind, g.detach(), val, model, frame, args)
    best = (start["accuracy"], -start["loss"], 0, g.detach().clone())
    history = [{"epoch": 0, "val_loss": start["loss"], "val_accuracy": start["accuracy"], "moved": 0}]
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(fit.enc.n_items, generator=order_rng)
        train_loss, train_acc, steps = 0.0, 0.0, 0
        for lo in range(0, order.shape[0], args.batch_size):
            out = _train_step(kind, g, optimizer, fit, order[lo: lo + args.batch_size], model, frame, args, l1)
            train_loss += out.losses["ce"]
            train_acc += out.metrics["accuracy"]
            steps += 1
        result = evaluate_fit(kind, g.detach(), val, model, frame, args)
        moved = int((g != 0).sum())
        history.append({"epoch": epoch, "train_loss": train_loss / steps, "train_accuracy": train_acc / steps,
                        "val_loss": result["loss"], "val_accuracy": result["accuracy"], "moved": moved})
        logger.info("%s seed %d l1 %g epoch %d: train loss %.4f acc %.3f, val loss %.4f acc %.3f, %d moved", kind,
                    seed, l1, epoch, train_loss / steps, train_acc / steps, result["loss"], result["accuracy"], moved)
        if (result["accuracy"], -result["loss"]) > best[:2]:
            best = (result["accuracy"], -result["loss"], epoch, g.detach().clone())
    val_acc, _, epoch, log_factors = best
    description = {**(meta or {}), "seed": seed, "l1": l1, "epoch": epoch, "val_accuracy": val_acc,
                   "val_accuracy_before": start["accuracy"], "fit_args": asdict(args),
                   "bank_fingerprint": bank_fingerprint(model)}
    controller: Controller = (PrototypeController(log_factors, description) if kind == "prototype"
                              else DenseController(frame, log_factors, description))
    return FitResult(controller, l1, epoch, val_acc, start["accuracy"], history)


def fit_best(kind: str, model: PrismForCausalLM, fit: CandidateFeatures, val: CandidateFeatures, args: FitArgs,
             seed: int, meta: dict | None = None) -> FitResult:
    """fit_controller for every L1 strength in args.l1; the best on validation (accuracy, then fewer moved)."""
    results = [fit_controller(kind, model, fit, val, args, seed, l1, meta) for l1 in args.l1]
    return max(results, key=lambda r: (r.val_accuracy, -len(r.controller.moved())))


# ----------------------------------------------------------------------------------------------------------------
# Exact evaluation and cost.


@torch.no_grad()
def correct_items(model: PrismForCausalLM, enc: EncodedItems, controller: Controller | None,
                 reduce: str = "mean") -> torch.Tensor:
    """(n_items,) bool, exact: the prototype controller through Interventions (model.head), the baseline through
    lm_head of its edited z, None for the plain model."""
    if isinstance(controller, DenseController):
        logprobs = exact_logprobs(model, enc, z_edit=controller.edit)
    else:
        logprobs = exact_logprobs(model, enc, None if controller is None else Interventions(controller=controller))
    return correct(option_scores(logprobs, enc, reduce), enc.answers)


def paired(after: torch.Tensor, before: torch.Tensor) -> dict:
    """Accuracy after, and the change against before on the same items: items fixed and broken, and the standard
    error of the gain in points (paired: only items that flip count)."""
    diff = after.double() - before.double()  # (n,) in {-1, 0, 1}
    n = diff.shape[0]
    se = float(diff.std(unbiased=True) / math.sqrt(n)) if n > 1 else float("nan")
    return {"accuracy": float(after.double().mean()), "fixed": int((after & ~before).sum()),
            "broken": int((~after & before).sum()), "gain_points": 100 * float(diff.mean()),
            "gain_se_points": 100 * se}


@torch.no_grad()
def inference_cost(model: PrismForCausalLM, controller: PrototypeController, z: torch.Tensor,
                   prompt_ids: torch.Tensor | None = None, new_tokens: int = 16, repeats: int = 5) -> dict:
    """What the controller adds at inference: its parameters, the multiply-adds it needs per token beside the LM
    head's, and measured times with and without it (median of `repeats`): the head on states z (T, d), and
    cached greedy generation of new_tokens after prompt_ids (1, T) when given."""
    d, vocab, k = model.d_model, model.vocab_size, model.config.top_k
    iv = Interventions(controller=controller)

    def median_time(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    head = {name: median_time(lambda iv=value: model.head(z[None], iv)) / z.shape[0] * 1e3
            for name, value in (("plain", None), ("controller", iv))}
    cost = {"parameters": controller.n_parameters, "nonzero_parameters": len(controller.moved()),
            # k factors times k activations, then the change of z: k rows of d (the LM head itself: V x d)
            "extra_macs_per_token": k + k * d, "lm_head_macs_per_token": vocab * d,
            "head_ms_per_token": head, "head_overhead": head["controller"] / head["plain"] - 1,
            "tokens_timed": int(z.shape[0])}
    if prompt_ids is not None:
        gen = {name: new_tokens / median_time(lambda iv=value: model.generate(prompt_ids, new_tokens,
                                                                               interventions=iv))
               for name, value in (("plain", None), ("controller", iv))}
        cost["generate_tokens_per_s"] = gen
    return cost


# ----------------------------------------------------------------------------------------------------------------
# The command line: fit and eval.


def _tokenizer_for(checkpoint: Path, model: PrismForCausalLM):
    from prism.backbones import load_tokenizer

    source = checkpoint if (checkpoint / "tokenizer_config.json").exists() else model.config.backbone
    if source is None:
        raise ValueError(f"{checkpoint} has no tokenizer and its config names no backbone to take one from")
    return load_tokenizer(str(source))


def task_files(spec: list[str]) -> dict[str, Path]:
    """{task name: items file} from files or folders of *.jsonl (precompute.controllers build writes them)."""
    files: list[Path] = []
    for s in spec:
        path = Path(s)
        files += sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no task files (*.jsonl) in {' '.join(spec)}")
    out = {}
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"no task file {f}")
        tasks = {it.task for it in read_items(f)}
        if len(tasks) != 1:
            raise ValueError(f"{f} mixes tasks {sorted(tasks)}: one task per file")
        out[tasks.pop()] = f
    return out


def encoded_task(model: PrismForCausalLM, tokenizer, task: str, items_file: Path, out: Path,
                 max_context_tokens: int, max_items: int | None) -> EncodedItems:
    """Every item of a task run through the backbone once, cached under OUT/cache (keyed by model, items, args)."""
    items = read_items(items_file)
    if max_items is not None:  # the first max_items of each split: smoke runs
        seen: Counter[str] = Counter()
        kept = []
        for it in items:
            if seen[it.split] < max_items:
                kept.append(it)
                seen[it.split] += 1
        items = kept
    key = {"bank": bank_fingerprint(model), "items": hashlib.sha256(items_file.read_bytes()).hexdigest(),
           "max_context_tokens": max_context_tokens, "max_items": max_items, "vocab": len(tokenizer)}
    path = out / CACHE_DIR / f"{task}.safetensors"
    if path.is_file():
        enc, stored = EncodedItems.load(path)
        if stored == key:
            logger.info("%s: %d encoded items from %s", task, enc.n_items, path)
            return enc
    enc = encode_items(model, tokenize_items(items, tokenizer, max_context_tokens), [it.split for it in items],
                       desc=f"encoding {task}")
    enc.save(path, key)
    return enc


def _split_counts(enc: EncodedItems) -> dict[str, int]:
    return {s: enc.splits.count(s) for s in ("fit", "val", "test")}


def run_fit(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    fit_args = FitArgs(**{f.name: getattr(args, f.name) for f in fields(FitArgs)})
    stored = {"checkpoint": str(args.checkpoint), "tasks": [str(t) for t in args.tasks], "kinds": list(args.kinds),
              "seeds": list(args.seeds), "max_context_tokens": args.max_context_tokens, "max_items": args.max_items,
              "fit": asdict(fit_args)}
    args_file = out / FIT_ARGS
    if args_file.is_file() and not args.overwrite:
        previous = json.loads(args_file.read_text())
        if previous != json.loads(json.dumps(stored)):
            raise ValueError(f"{out} holds controllers fitted with other arguments ({args_file}); use --overwrite "
                             "or another --out")
    out.mkdir(parents=True, exist_ok=True)
    args_file.write_text(json.dumps(stored, indent=2))
    checkpoint = Path(args.checkpoint)
    model = PrismForCausalLM.from_pretrained(checkpoint).eval()
    model.requires_grad_(False)
    tokenizer = _tokenizer_for(checkpoint, model)
    summary: dict = {}
    for task, items_file in task_files(args.tasks).items():
        enc = encoded_task(model, tokenizer, task, items_file, out, args.max_context_tokens, args.max_items)
        feats = {s: candidate_features(model, enc.subset(s), fit_args.candidates) for s in ("fit", "val")}
        summary[task] = {"items": _split_counts(enc), "controllers": {}}
        for kind in args.kinds:
            for seed in args.seeds:
                path = out / task / f"{kind}-seed{seed}.safetensors"
                if path.is_file() and not args.overwrite:
                    logger.info("%s exists, kept", path)
                    controller = load_controller(path, model)
                    result_meta = controller.meta
                else:
                    result = fit_best(kind, model, feats["fit"], feats["val"], fit_args, seed,
                                      meta={"task": task, "items_file": str(items_file)})
                    save_controller(result.controller, path)
                    result_meta = {**result.controller.meta, "history": result.history}
                summary[task]["controllers"][path.name] = {
                    k: result_meta.get(k) for k in ("seed", "l1", "epoch", "val_accuracy", "val_accuracy_before",
                                                    "history")} | {"moved": len(load_controller(path).moved())}
    (out / FIT_SUMMARY).write_text(json.dumps(summary, indent=2))
    return summary


def _spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "per_seed": values}


def run_eval(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    args_file = out / FIT_ARGS
    if not args_file.is_file():
        raise FileNotFoundError(f"{out} has no {FIT_ARGS}: run `python -m prism.controllers fit` first")
    stored = json.loads(args_file.read_text())
    checkpoint = Path(args.checkpoint or stored["checkpoint"])
    model = PrismForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = _tokenizer_for(checkpoint, model)
    reduce = stored["fit"]["reduce"]
    results: dict = {"checkpoint": str(checkpoint), "score": reduce, "tasks": {}}
    for task, items_file in task_files(stored["tasks"]).items():
        enc = encoded_task(model, tokenizer, task, items_file, out, stored["max_context_tokens"],
                           stored["max_items"])
        test = enc.subset("test")
        before = correct_items(model, test, None, reduce)
        row: dict = {"items": _split_counts(enc), "before": float(before.double().mean())}
        per_kind: dict[str, list] = {k: [] for k in KINDS}
        for path in sorted((out / task).glob("*.safetensors")):
            controller = load_controller(path, model)
            per_kind[controller.kind].append((controller, paired(correct_items(model, test, controller, reduce),
                                                                 before)))
        for kind, fitted in per_kind.items():
            if not fitted:
                continue
            row[kind] = {**_spread([r["accuracy"] for _, r in fitted]),
                         "gain_points": statistics.fmean(r["gain_points"] for _, r in fitted),
                         "per_seed_paired": [r for _, r in fitted], "moved": [len(c.moved()) for c, _ in fitted],
                         "seeds": [c.meta.get("seed") for c, _ in fitted],
                         "l1": [c.meta.get("l1") for c, _ in fitted]}
        protos = [c for c, _ in per_kind["prototype"]]
        if protos:
            row["top_prototypes"] = top_moved(protos, args.top)
            prompt = torch.tensor([tokenizer(COST_PROMPT, add_special_tokens=False)["input_ids"]])
            row["cost"] = inference_cost(model, protos[0], test.z[: args.cost_tokens], prompt, repeats=3)
        results["tasks"][task] = row
    results["mean_gain_points"] = {kind: statistics.fmean(r[kind]["gain_points"] for r in results["tasks"].values()
                                                          if kind in r)
                                   for kind in KINDS if any(kind in r for r in results["tasks"].values())}
    results["summary"] = {task: {"before": r["before"], **{kind: f"{100 * r[kind]['mean']:.2f} +- "
                                                             f"{100 * r[kind]['std']:.2f}" for kind in KINDS
                                                             if kind in r}}
                          for task, r in results["tasks"].items()}
    (out / EVAL_RESULTS).write_text(json.dumps(results, indent=2))
    return results


def top_moved(controllers: list[PrototypeController], n: int) -> dict[str, list[dict]]:
    """The prototypes the seeds' controllers moved most, by mean log-factor: raised and lowered, with the factor
    per seed and how many seeds moved each."""
    g = torch.stack([c.log_factors for c in controllers])  # (S, K)
    mean = g.mean(0)
    order = mean.argsort(descending=True).tolist()

    def rows(ids):
        return [{"prototype_id": int(i), "mean_factor": float(mean[i].exp()),
                 "factors": [float(v) for v in g[:, i].exp()], "seeds_moving": int((g[:, i] != 0).sum())}
                for i in ids]

    return {"raised": rows([i for i in order if mean[i] > 0][:n]),
            "lowered": rows([i for i in reversed(order) if mean[i] < 0][:n])}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m prism.controllers", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    fit = commands.add_parser("fit", help="fit prototype controllers and the dense baseline per task and seed",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    fit.add_argument("--checkpoint", required=True, help="PRISM checkpoint folder (save_pretrained)")
    fit.add_argument("--tasks", required=True, nargs="+", help="task files (*.jsonl) or folders of them "
                                                                 "(python -m precompute.controllers build)")
    fit.add_argument("--out", required=True, help="folder for controllers, caches and fit.json")
    fit.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="what to fit")
    fit.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="one fit per seed (item order; the "
                                                                              "baseline's frame)")
    fit.add_argument("--max-context-tokens", type=int, default=128, help="context tokens kept before the options")
    fit.add_argument("--max-items", type=int, default=None, help="only the first N items of each split (smoke runs)")
    fit.add_argument("--overwrite", action="store_true", help="refit, replacing controllers in --out")
    defaults = FitArgs()
    helps = {"epochs": "passes over the fit items (the best epoch on validation is kept, the identity included)",
             "lr": "Adam step size on g = log(factor)", "batch_size": "items per step",
             "l1": "soft-threshold strengths to try, one fit each (validation picks); in (0, 1): dense to empty",
             "max_moved": "top-m: at most this many prototypes (baseline: frame directions) move",
             "max_factor": "factors stay in [1/max_factor, max_factor]",
             "temperature": "option scores / temperature -> softmax over the options",
             "reduce": "option score: mean or sum of its token log-probabilities",
             "candidates": "tokens per position in the fit's softmax beside the target (the rest: one term)"}
    group = fit.add_argument_group("optimisation")
    for f in fields(FitArgs):
        default = getattr(defaults, f.name)
        flag = "--" + f.name.replace("_", "-")
        if f.name == "l1":
            group.add_argument(flag, type=float, nargs="+", default=list(default), help=helps[f.name])
        elif f.name == "max_moved":
            group.add_argument(flag, type=int, default=None, help=helps[f.name])
        elif f.name == "reduce":
            group.add_argument(flag, choices=REDUCTIONS, default=default, help=helps[f.name])
        else:
            group.add_argument(flag, type=type(default), default=default, help=helps[f.name])
    ev = commands.add_parser("eval", help="exact test accuracy before/after each controller; prints JSON",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ev.add_argument("--out", required=True, help="the folder `fit` wrote")
    ev.add_argument("--checkpoint", help="default: the one fit used")
    ev.add_argument("--top", type=int, default=10, help="moved prototypes to list per direction")
    ev.add_argument("--cost-tokens", type=int, default=512, help="test positions to time the head on")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logger.info("arguments: %s", json.dumps(vars(args)))
    try:
        result = run_fit(args) if args.command == "fit" else run_eval(args)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    if args.command == "eval":
        sys.stdout.write(json.dumps(result, indent=2) + "\n")  # the command's output
    return result


if __name__ == "__main__":
    main()
