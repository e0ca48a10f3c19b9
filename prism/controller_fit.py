"""Fitting a prototype controller (prism/controllers.py) on multiple-choice items: the item format, every item
encoded through the model once, and a fit of the K log-factors that only replays the prototype head.

An item is a context and a few options, one of them right (bench/controller_tasks.py builds them from held-out
documents). An option's score is the mean log-probability of its tokens given the context and the option's
earlier tokens (`reduce="mean"`; "sum" is the alternative). The mean is the default because the options of one
item differ in length (a true next sentence against sentences from other documents) and a sum favours short
options whatever they say; lm-eval-harness calls the length-normalised variant acc_norm.

Controllers change only the prototype head, so every item is run through the backbone once (encode_items: the
context once, its KV cache repeated for the options) and the final states z of the scored positions are kept:
position n holds z (the state that predicts token targets[n]). Exact scoring (exact_logprobs) sends those z through
model.head with the request's Interventions, the code path forward/stream/generate use. Fitting needs many passes,
and a full-vocabulary softmax per position per step is too slow on a CPU, so candidate_features keeps per position
the target plus the M most likely other tokens and a one-token summary of the rest of the vocabulary (its
logsumexp and the gradient direction of its mass); candidate_logprobs is exact when nothing moves and when M covers
the vocabulary, and to first order in the change of z for the rest. Test accuracy is always exact.

The fit: the loss is the cross-entropy of the right option over the options' scores / temperature; Adam on
g = log(factor), then after every step a soft threshold (L1, proximal step), the factor bounds and an optional
top-m cap, so most prototypes keep factor 1. The epoch with the best validation accuracy (then loss) is kept, the
identity (epoch 0) included; fit_best tries every L1 strength and keeps the best on validation. A step returns the
loss, one entry per loss term and metrics. The fit is written for any kind of controller with K log-factors
(ControllerKind: how g changes the fit's log-probabilities and how the fitted controller is built); PROTOTYPE is
the library's, the dense baseline of the experiment is another (bench/dense_controller.py).

    items = read_items("tasks/next_sentence.jsonl")
    enc = encode_items(model, tokenize_items(items, tokenizer), [it.split for it in items])
    feats = {s: candidate_features(model, enc.subset(s)) for s in ("fit", "val")}
    result = fit_best(PROTOTYPE, model, feats["fit"], feats["val"], FitArgs(), seed=0)
    save_controller(result.controller, "ctl.safetensors")
    test = enc.subset("test")
    acc = accuracy(option_scores(exact_logprobs(model, test, Interventions(controller=result.controller)), test),
                   test.answers)

The experiment's command line (tasks, seeds, the dense baseline, exact test accuracy, timing) is
`python -m bench.controllers fit|eval`.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from prism.controllers import PrototypeController, bank_fingerprint
from prism.model import Interventions, PrismForCausalLM

logger = logging.getLogger(__name__)

SPLITS = ("fit", "val", "test")
REDUCTIONS = ("mean", "sum")


# ----------------------------------------------------------------------------------------------------------------
# Items.


@dataclass(frozen=True)
class MCItem:
    """One multiple-choice item. options are continuations of context (they carry their own leading space)."""

    item_id: str
    task: str
    doc_id: str  # the held-out document the item is built from
    source: str
    split: str  # fit | val | test, decided per document
    context: str
    options: tuple[str, ...]
    answer: int  # index of the right option
    meta: dict = field(default_factory=dict)  # how the item was made (e.g. the documents of the distractors)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", tuple(self.options))
        if self.split not in SPLITS:
            raise ValueError(f"{self.item_id}: split must be one of {SPLITS}, got {self.split!r}")
        if len(self.options) < 2 or not 0 <= self.answer < len(self.options):
            raise ValueError(f"{self.item_id}: needs >= 2 options and an answer index among them")


def write_items(items: Iterable[MCItem], path: str | Path) -> int:
    """Write items as jsonl (one object per line, fields as MCItem); returns how many."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    n = 0
    with tmp.open("w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps({**asdict(item), "options": list(item.options)}, ensure_ascii=False) + "\n")
            n += 1
    tmp.replace(path)
    return n


def read_items(path: str | Path) -> list[MCItem]:
    items = []
    with Path(path).open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if line.strip():
                try:
                    items.append(MCItem(**json.loads(line)))
                except (json.JSONDecodeError, TypeError) as err:
                    raise ValueError(f"{path}:{n}: not a multiple-choice item ({err})") from err
    if not items:
        raise ValueError(f"{path} holds no items")
    return items


@dataclass(frozen=True)
class TokenizedItem:
    context_ids: tuple[int, ...]
    option_ids: tuple[tuple[int, ...], ...]
    answer: int


def tokenize_items(items: Sequence[MCItem], tokenizer, max_context_tokens: int = 128) -> list[TokenizedItem]:
    """Context and options tokenized separately (no special tokens); the context keeps its last
    max_context_tokens tokens."""
    out = []
    for item in items:
        ctx = tokenizer(item.context, add_special_tokens=False)["input_ids"][-max_context_tokens:]
        opts = tuple(tuple(tokenizer(o, add_special_tokens=False)["input_ids"]) for o in item.options)
        if not ctx or not all(opts):
            raise ValueError(f"{item.item_id}: the context and every option need at least one token")
        out.append(TokenizedItem(tuple(ctx), opts, item.answer))
    return out


# ----------------------------------------------------------------------------------------------------------------
# Encoding: the final states of every scored position, computed once.


@dataclass
class EncodedItems:
    """Scored positions of a set of items with the same number of options, flattened.

    Positions of one item are contiguous (option 0's tokens, then option 1's, ...).
    """

    z: torch.Tensor  # (N, d) final state that predicts targets[n]
    targets: torch.Tensor  # (N,) long
    position_option: torch.Tensor  # (N,) long, global option index of each position
    option_length: torch.Tensor  # (n_items * n_options,) long, scored tokens per option
    item_start: torch.Tensor  # (n_items + 1,) long, first position of each item (and the end)
    answers: torch.Tensor  # (n_items,) long
    splits: list[str]
    n_options: int

    @property
    def n_items(self) -> int:
        return int(self.answers.shape[0])

    def subset(self, split: str) -> EncodedItems:
        return self.select([i for i, s in enumerate(self.splits) if s == split])

    def select(self, items: Sequence[int]) -> EncodedItems:
        """The given items (indices), renumbered from 0."""
        items = torch.as_tensor(list(items), dtype=torch.long)
        positions = self.positions(items)
        starts, ends = self.item_start[items], self.item_start[items + 1]
        options = (items[:, None] * self.n_options + torch.arange(self.n_options)).reshape(-1)
        # the global option index of each kept position, renumbered to the kept options
        remap = torch.full((self.option_length.shape[0],), -1, dtype=torch.long)
        remap[options] = torch.arange(options.shape[0])
        return EncodedItems(
            z=self.z[positions], targets=self.targets[positions],
            position_option=remap[self.position_option[positions]],
            option_length=self.option_length[options],
            item_start=torch.cat([torch.zeros(1, dtype=torch.long), (ends - starts).cumsum(0)]),
            answers=self.answers[items], splits=[self.splits[int(i)] for i in items], n_options=self.n_options)

    def positions(self, items: torch.Tensor) -> torch.Tensor:
        """All positions of the given items, in order. items (n,) long -> (P,) long."""
        starts = self.item_start[items]
        lengths = self.item_start[items + 1] - starts
        # position = its item's start + its rank inside the item
        first = lengths.cumsum(0) - lengths  # where each item begins in the output
        return torch.repeat_interleave(starts - first, lengths) + torch.arange(int(lengths.sum()))

    def save(self, path: str | Path, metadata: dict) -> None:
        tensors = {name: getattr(self, name).contiguous() for name in
                   ("z", "targets", "position_option", "option_length", "item_start", "answers")}
        meta = {"splits": json.dumps(self.splits), "n_options": str(self.n_options), "key": json.dumps(metadata)}
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".partial")
        save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> tuple[EncodedItems, dict]:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        tensors = load_file(str(path))
        enc = cls(**tensors, splits=json.loads(meta["splits"]), n_options=int(meta["n_options"]))
        return enc, json.loads(meta["key"])


@torch.no_grad()
def encode_items(model: PrismForCausalLM, items: Sequence[TokenizedItem], splits: Sequence[str],
                 batch_size: int = 8, desc: str = "encoding") -> EncodedItems:
    """Run every item through the backbone once: a batch of contexts (left-padded) with a KV cache, then all their
    options as one batch on that cache (repeated per option; options are right-padded, which causal attention
    never lets a real position see)."""
    if not items:
        raise ValueError("no items to encode")
    n_options = len(items[0].option_ids)
    if any(len(it.option_ids) != n_options for it in items):
        raise ValueError("every item needs the same number of options")
    limit = model.max_length
    zs, targets, position_option, option_length, item_start = [], [], [], [], [0]
    for lo in tqdm(range(0, len(items), batch_size), desc=desc, unit="batch", leave=False):
        batch = items[lo: lo + batch_size]
        n_ctx = torch.tensor([len(it.context_ids) for it in batch])  # (B,)
        longest = max(len(o) for it in batch for o in it.option_ids)
        width = int(n_ctx.max())
        if limit is not None and width + longest > limit:
            raise ValueError(f"items {lo}..{lo + len(batch) - 1} need {width + longest} positions; the model "
                             f"takes {limit}")
        ctx = torch.zeros(len(batch), width, dtype=torch.long)  # (B, Tc), left-padded
        ctx_mask = torch.zeros_like(ctx)
        for b, it in enumerate(batch):
            ctx[b, width - len(it.context_ids):] = torch.tensor(it.context_ids)
            ctx_mask[b, width - len(it.context_ids):] = 1
        positions = (ctx_mask.cumsum(-1) - 1).clamp_min(0)
        z_ctx, cache = model.final_states(ctx, ctx_mask, positions, use_cache=True)  # (B, Tc, d)
        cache.batch_repeat_interleave(n_options)
        opts = torch.zeros(len(batch) * n_options, longest, dtype=torch.long)  # (B * n_options, To), right-padded
        for b, it in enumerate(batch):
            for o, ids in enumerate(it.option_ids):
                opts[b * n_options + o, : len(ids)] = torch.tensor(ids)
        mask = torch.cat([ctx_mask.repeat_interleave(n_options, 0), torch.ones_like(opts)], dim=1)
        opt_positions = n_ctx.repeat_interleave(n_options)[:, None] + torch.arange(longest)  # (B * n_options, To)
        z_opt, _ = model.final_states(opts, mask, opt_positions, cache=cache, use_cache=True)  # (B * n_opt, To, d)
        for b, it in enumerate(batch):
            n = lo + b
            for o, ids in enumerate(it.option_ids):
                # the last context state predicts the option's first token, option token j predicts token j + 1
                zs.append(torch.cat([z_ctx[b, -1:], z_opt[b * n_options + o, : len(ids) - 1]]))
                targets.append(torch.tensor(ids))
                position_option.append(torch.full((len(ids),), n * n_options + o))
                option_length.append(len(ids))
            item_start.append(item_start[-1] + sum(len(ids) for ids in it.option_ids))
    return EncodedItems(
        z=torch.cat(zs).float(), targets=torch.cat(targets).long(), position_option=torch.cat(position_option).long(),
        option_length=torch.tensor(option_length), item_start=torch.tensor(item_start),
        answers=torch.tensor([it.answer for it in items]), splits=list(splits), n_options=n_options)


# ----------------------------------------------------------------------------------------------------------------
# Scores.


def option_scores(logprobs: torch.Tensor, enc: EncodedItems, reduce: str = "mean") -> torch.Tensor:
    """Per-position log-probabilities (N,) -> option scores (n_items, n_options): their sum or mean per option."""
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    total = torch.zeros(enc.option_length.shape[0], dtype=logprobs.dtype).index_add(0, enc.position_option, logprobs)
    if reduce == "mean":
        total = total / enc.option_length.to(logprobs.dtype)
    return total.view(enc.n_items, enc.n_options)


def correct(scores: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """(n_items,) bool: the right option has the highest score (a tie counts as wrong)."""
    right = scores.gather(1, answers[:, None])[:, 0]  # (n,)
    others = scores.masked_fill(F.one_hot(answers, scores.shape[1]).bool(), float("-inf"))
    return right > others.max(1).values


def accuracy(scores: torch.Tensor, answers: torch.Tensor) -> float:
    """Fraction of items whose right option has the highest score."""
    if scores.shape[0] == 0:
        return float("nan")
    return float(correct(scores, answers).double().mean())


@torch.no_grad()
def exact_logprobs(model: PrismForCausalLM, enc: EncodedItems, interventions: Interventions | None = None,
                   z_edit=None, chunk: int = 256) -> torch.Tensor:
    """log p(target | everything before) at every position over the full vocabulary, (N,).

    With interventions the logits come from model.head(z, interventions), the path of forward and generation;
    z_edit (a function z -> z') is for controllers that are not prototype interventions (the dense baseline).
    """
    out = []
    for lo in range(0, enc.z.shape[0], chunk):
        z = enc.z[lo: lo + chunk]  # (n, d)
        if z_edit is not None:
            logits = model.lm_head(z_edit(z))  # (n, V)
        else:
            logits = model.head(z[None], interventions).logits[0]  # (n, V)
        out.append(logits.float().log_softmax(-1).gather(1, enc.targets[lo: lo + chunk, None])[:, 0])
    return torch.cat(out) if out else torch.zeros(0)


# ----------------------------------------------------------------------------------------------------------------
# Candidate features: what fitting needs per position, computed once.


@dataclass
class CandidateFeatures:
    """Per position: candidate tokens (slot 0 = the target) and their logits, the rest of the vocabulary as one
    pseudo-token, the model's own top-k prototypes, and the projections fitting uses.

    With q the softmax of the plain logits over the tail (tokens outside the candidates) and
    m_tail = sum_v q_v W_v, the tail's logsumexp after z -> z + dz is lse_tail + m_tail . dz to first order
    (a lower bound, by Jensen's inequality), exact at dz = 0 in value and gradient.
    """

    enc: EncodedItems
    candidates: torch.Tensor  # (N, M + 1) long, candidates[:, 0] == targets
    cand_logits: torch.Tensor  # (N, M + 1) plain logits of the candidates
    lse_tail: torch.Tensor  # (N,) logsumexp of the plain logits over the tail (-inf when there is none)
    m_tail: torch.Tensor  # (N, d)
    prototype_ids: torch.Tensor  # (N, k) long, the model's own top-k
    activations: torch.Tensor  # (N, k)
    cand_signatures: torch.Tensor  # (N, M + 1, k): W_c . p_i for candidate c and active prototype i
    tail_signatures: torch.Tensor  # (N, k): m_tail . p_i


@torch.no_grad()
def candidate_features(model: PrismForCausalLM, enc: EncodedItems, n_candidates: int = 32,
                       chunk: int = 256) -> CandidateFeatures:
    vocab = model.vocab_size
    m = min(n_candidates, vocab - 1)
    weight, bank = model.lm_head.weight, model.prototypes.weight  # (V, d), (K, d)
    parts: dict[str, list[torch.Tensor]] = {n: [] for n in ("candidates", "cand_logits", "lse_tail", "m_tail",
                                                             "prototype_ids", "activations", "cand_signatures",
                                                             "tail_signatures")}
    for lo in tqdm(range(0, enc.z.shape[0], chunk), desc="candidate features", unit="chunk", leave=False):
        z, target = enc.z[lo: lo + chunk], enc.targets[lo: lo + chunk]  # (n, d), (n,)
        out = model.head(z[None])
        logits = out.logits[0].float()  # (n, V)
        ids, acts = out.prototype_ids[0], out.activations[0]  # (n, k)
        ranked = logits.scatter(1, target[:, None], float("-inf")).topk(m, dim=-1).indices  # (n, M), no target
        cand = torch.cat([target[:, None], ranked], dim=1)  # (n, M + 1)
        tail = logits.scatter(1, cand, float("-inf"))  # (n, V)
        lse_tail = tail.logsumexp(-1)  # (n,)
        if m == vocab - 1:
            m_tail = torch.zeros_like(z)
        else:
            m_tail = tail.softmax(-1) @ weight  # (n, d)
        protos = bank[ids]  # (n, k, d)
        parts["candidates"].append(cand)
        parts["cand_logits"].append(logits.gather(1, cand))
        parts["lse_tail"].append(lse_tail)
        parts["m_tail"].append(m_tail)
        parts["prototype_ids"].append(ids)
        parts["activations"].append(acts)
        parts["cand_signatures"].append(torch.einsum("nmd,nkd->nmk", weight[cand], protos))
        parts["tail_signatures"].append(torch.einsum("nd,nkd->nk", m_tail, protos))
    return CandidateFeatures(enc=enc, **{n: torch.cat(v) for n, v in parts.items()})


def candidate_logprobs(feats: CandidateFeatures, positions: torch.Tensor, d_cand: torch.Tensor,
                       d_tail: torch.Tensor) -> torch.Tensor:
    """Approximate log p(target) at the given positions (P,) after logit shifts d_cand (P, M + 1) of the
    candidates and d_tail (P,) of the tail pseudo-token (class docstring). Differentiable in the shifts."""
    logits = feats.cand_logits[positions] + d_cand  # (P, M + 1)
    lse = torch.logaddexp(logits.logsumexp(-1), feats.lse_tail[positions] + d_tail)  # (P,)
    return logits[:, 0] - lse


# ----------------------------------------------------------------------------------------------------------------
# The fit.


@dataclass(frozen=True)
class ControllerKind:
    """What the fit needs to know about a kind of controller with K log-factors g.

    logprobs(g, feats, positions, model, fixed) -> the fit's log p(target) at positions (P,), differentiable in g;
    build(g, fixed, description) -> the fitted controller; fixed(model, seed) -> what the kind draws once per seed
    and keeps fixed during the fit (None for prototype controllers).
    """

    name: str
    logprobs: Callable[[torch.Tensor, CandidateFeatures, torch.Tensor, PrismForCausalLM, Any], torch.Tensor]
    build: Callable[[torch.Tensor, Any, dict], Any]
    fixed: Callable[[PrismForCausalLM, int], Any] = lambda model, seed: None


def _prototype_logprobs(log_factors: torch.Tensor, feats: CandidateFeatures, positions: torch.Tensor,
                        model: PrismForCausalLM, fixed: None) -> torch.Tensor:
    """The fit's log p(target) at positions (P,) under prototype factors exp(log_factors) (K,)."""
    ids, acts = feats.prototype_ids[positions], feats.activations[positions]  # (P, k)
    # the same reweighting head() applies, through the same Interventions path
    _, new = model.effective_activations(ids, acts, Interventions(controller=PrototypeController(log_factors)))
    change = new - acts  # (P, k)
    d_cand = torch.einsum("pmk,pk->pm", feats.cand_signatures[positions], change)  # (P, M + 1)
    d_tail = (feats.tail_signatures[positions] * change).sum(-1)  # (P,)
    return candidate_logprobs(feats, positions, d_cand, d_tail)


PROTOTYPE = ControllerKind("prototype", _prototype_logprobs,
                           build=lambda g, fixed, description: PrototypeController(g, description))


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
    controller: Any  # what kind.build made (a PrototypeController for PROTOTYPE)
    l1: float
    epoch: int  # 0 = no epoch beat the identity on validation
    val_accuracy: float
    val_accuracy_before: float
    history: list[dict]


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


def fit_objective(kind: ControllerKind, log_factors: torch.Tensor, feats: CandidateFeatures, items: torch.Tensor,
                  model: PrismForCausalLM, fixed: Any, args: FitArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy of the right option over items (B,), and the option scores (B, n_options)."""
    enc = feats.enc
    logprobs = kind.logprobs(log_factors, feats, enc.positions(items), model, fixed)
    scores = batch_scores(enc, items, logprobs, args.reduce)
    loss = torch.nn.functional.cross_entropy(scores / args.temperature, enc.answers[items])
    return loss, scores


def _train_step(kind, log_factors, optimizer, feats, items, model, fixed, args, l1) -> StepOutput:
    optimizer.zero_grad()
    loss, scores = fit_objective(kind, log_factors, feats, items, model, fixed, args)
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
def evaluate_fit(kind, log_factors, feats, model, fixed, args, batch_size: int = 64) -> dict[str, float]:
    """Loss and accuracy of the fit objective on all items of feats (validation)."""
    losses, scores = [], []
    for lo in range(0, feats.enc.n_items, batch_size):
        items = torch.arange(lo, min(lo + batch_size, feats.enc.n_items))
        loss, s = fit_objective(kind, log_factors, feats, items, model, fixed, args)
        losses.append(float(loss) * items.shape[0])
        scores.append(s)
    scores_all = torch.cat(scores)
    return {"loss": sum(losses) / feats.enc.n_items, "accuracy": accuracy(scores_all, feats.enc.answers)}


def fit_controller(kind: ControllerKind, model: PrismForCausalLM, fit: CandidateFeatures, val: CandidateFeatures,
                   args: FitArgs, seed: int, l1: float, meta: dict | None = None) -> FitResult:
    """Fit one controller (one L1 strength, one seed); keep the epoch with the best validation accuracy (then
    loss), the identity (epoch 0) included."""
    if not isinstance(kind, ControllerKind):
        raise TypeError(f"kind must be a ControllerKind (e.g. PROTOTYPE), got {kind!r}")
    n = model.config.n_prototypes
    fixed = kind.fixed(model, seed)
    g = torch.zeros(n, requires_grad=True)
    optimizer = torch.optim.Adam([g], lr=args.lr)
    order_rng = torch.Generator().manual_seed(seed)
    start = evaluate_fit(kind, g.detach(), val, model, fixed, args)
    best = (start["accuracy"], -start["loss"], 0, g.detach().clone())
    history = [{"epoch": 0, "val_loss": start["loss"], "val_accuracy": start["accuracy"], "moved": 0}]
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(fit.enc.n_items, generator=order_rng)
        train_loss, train_acc, steps = 0.0, 0.0, 0
        for lo in range(0, order.shape[0], args.batch_size):
            out = _train_step(kind, g, optimizer, fit, order[lo: lo + args.batch_size], model, fixed, args, l1)
            train_loss += out.losses["ce"]
            train_acc += out.metrics["accuracy"]
            steps += 1
        result = evaluate_fit(kind, g.detach(), val, model, fixed, args)
        moved = int((g != 0).sum())
        history.append({"epoch": epoch, "train_loss": train_loss / steps, "train_accuracy": train_acc / steps,
                        "val_loss": result["loss"], "val_accuracy": result["accuracy"], "moved": moved})
        logger.info("%s seed %d l1 %g epoch %d: train loss %.4f acc %.3f, val loss %.4f acc %.3f, %d moved", kind.name,
                    seed, l1, epoch, train_loss / steps, train_acc / steps, result["loss"], result["accuracy"], moved)
        if (result["accuracy"], -result["loss"]) > best[:2]:
            best = (result["accuracy"], -result["loss"], epoch, g.detach().clone())
    val_acc, _, epoch, log_factors = best
    description = {**(meta or {}), "seed": seed, "l1": l1, "epoch": epoch, "val_accuracy": val_acc,
                   "val_accuracy_before": start["accuracy"], "fit_args": asdict(args),
                   "bank_fingerprint": bank_fingerprint(model)}
    return FitResult(kind.build(log_factors, fixed, description), l1, epoch, val_acc, start["accuracy"], history)


def fit_best(kind: ControllerKind, model: PrismForCausalLM, fit: CandidateFeatures, val: CandidateFeatures,
             args: FitArgs, seed: int, meta: dict | None = None) -> FitResult:
    """fit_controller for every L1 strength in args.l1; the best on validation (accuracy, then fewer moved)."""
    results = [fit_controller(kind, model, fit, val, args, seed, l1, meta) for l1 in args.l1]
    return max(results, key=lambda r: (r.val_accuracy, -len(r.controller.moved())))
