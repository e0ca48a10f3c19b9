"""How much of a prediction the prototypes carry: the prototype path `W z_hat + b` against the full head `W z + b`.

The decomposition `l = W r + b + sum_i a_i W p_i` is exact whatever the bank, so it can be exact and still explain
little: the directions that separate one candidate token from another may sit in the residual r. These functions
measure what the prototype part decides (docs/DESIGN.md section 2, "What the explanation carries"):

- agreement:   argmax of the prototype path's logits W z_hat + b equals the full model's argmax;
- path CE:     cross-entropy of the prototype path on the true next token (beside the full model's);
- KL:          KL(softmax(full) || softmax(path)), how far the path's distribution is from the model's;
- margin share: for the model's top-1 token a and top-2 token b, the part of the margin l_a - l_b that the
  prototypes' slices carry, (W_a - W_b) . z_hat / (l_a - l_b); 1 - share is the residual's (bias included, as in
  the decomposition, where the residual slice holds the LM head's bias).

    stats = path_statistics(z, z_hat, model.lm_head.weight, model.lm_head.bias, labels)   # per position
    summary = summarize_path(stats)    # {"agreement", "path_ce", "full_ce", "kl", "margin_share_median", ...}
    carried_share(dec_a, dec_b)        # the same share from two Decompositions at one position
    Carried.of(dec_a, dec_b, "runner")  # that share as the app shows it (None when the two logits tie)
    token_diff(original_ids, intervened_ids)   # where an intervened continuation departs from the original

One position of a model's output, explained (what the app shows when a token is clicked; z is the final state at
the position that chose the token, from the generation's own forward or one pass over the text):

    ex = explain_token(model, z, token_id, interventions, n_alternatives=5)     # one call per click
    ex.chosen, ex.alternatives, ex.carried       # Decompositions (slices add up to each logit), the share carried
    contrast(ex.chosen, ex.alternatives[1])      # why A and not B: the margin as residual + one part per prototype
    contrast_tokens(model, z, a, b)              # the same for any two tokens
    explain_token(..., against=(original_ids, intervened_ids, index)).change   # what an intervention changed here
    logit_attrs(model, z, token_ids)             # (n, K) tensor: every prototype's slice of each token's logit
    pushers(model, token_id)                     # who pushes token X: the prototypes whose signature raises it most
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from prism.interventions import Interventions, changed_selection, restrict
from prism.losses import IGNORE_INDEX

if TYPE_CHECKING:
    from prism.model import Decomposition, PrismForCausalLM

# A share at or above this means the prototypes, not the residual, decide the choice between the two tokens.
CARRIES = 0.5


@dataclass
class PathStatistics:
    """Per-position measures over N positions (all (N,) tensors, float64 unless said).

    agree: bool, path argmax == full argmax; share: margin share (nan where the top two logits tie);
    kl: KL(full || path); full_nll, path_nll: -log p of the label (nan where the label is IGNORE_INDEX)."""

    agree: torch.Tensor
    share: torch.Tensor
    kl: torch.Tensor
    full_nll: torch.Tensor
    path_nll: torch.Tensor

    def cat(self, other: PathStatistics) -> PathStatistics:
        return PathStatistics(*(torch.cat([getattr(self, f), getattr(other, f)]) for f in FIELDS))


FIELDS = ("agree", "share", "kl", "full_nll", "path_nll")


@torch.no_grad()
def path_statistics(z: torch.Tensor, z_hat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    labels: torch.Tensor | None = None, chunk: int = 512) -> PathStatistics:
    """The measures of the module docstring at every position. z, z_hat (N, d) or (..., d); weight (V, d) the LM
    head; bias (V,) or None; labels (N,) or z's leading shape: the token each position predicts (IGNORE_INDEX where
    none). Computed in float32 over chunks of `chunk` positions, so (chunk, V) is the largest tensor built."""
    d = z.shape[-1]
    z, z_hat = z.reshape(-1, d), z_hat.reshape(-1, d)  # (N, d)
    if z_hat.shape != z.shape:
        raise ValueError(f"z {tuple(z.shape)} and z_hat {tuple(z_hat.shape)} must have the same shape")
    if labels is not None:
        labels = labels.reshape(-1)
        if labels.shape[0] != z.shape[0]:
            raise ValueError(f"{labels.shape[0]} labels for {z.shape[0]} positions")
    w = weight.float()
    b = None if bias is None else bias.float()
    parts = []
    for lo in range(0, z.shape[0], chunk):
        zc, hc = z[lo: lo + chunk].float(), z_hat[lo: lo + chunk].float()
        full = F.linear(zc, w, b)  # (n, V)
        path = F.linear(hc, w, b)  # (n, V)
        top2 = full.topk(2, dim=-1)
        a, second = top2.indices[:, 0], top2.indices[:, 1]  # (n,)
        margin = (top2.values[:, 0] - top2.values[:, 1]).double()  # (n,) includes the bias
        proto = ((w[a] - w[second]) * hc).sum(-1).double()  # (n,) the prototypes' part of the margin
        share = torch.where(margin > 0, proto / margin.clamp_min(1e-30), torch.full_like(margin, math.nan))
        log_full, log_path = full.log_softmax(-1), path.log_softmax(-1)  # (n, V)
        kl = (log_full.exp() * (log_full - log_path)).sum(-1).double()
        if labels is None:
            full_nll = path_nll = torch.full_like(margin, math.nan)
        else:
            lab = labels[lo: lo + chunk]
            keep = lab != IGNORE_INDEX
            safe = torch.where(keep, lab, torch.zeros_like(lab)).unsqueeze(-1)
            nan = torch.full_like(margin, math.nan)
            full_nll = torch.where(keep, -log_full.gather(-1, safe).squeeze(-1).double(), nan)
            path_nll = torch.where(keep, -log_path.gather(-1, safe).squeeze(-1).double(), nan)
        parts.append(PathStatistics(path.argmax(-1) == a, share, kl, full_nll, path_nll))
    out = parts[0]
    for part in parts[1:]:
        out = out.cat(part)
    return out


def summarize_path(stats: PathStatistics) -> dict[str, float]:
    """Means over positions (CE over labelled positions only; the share's median and the fraction of positions
    where it is >= CARRIES, over positions without a tie)."""
    labelled = ~torch.isnan(stats.full_nll)
    share = stats.share[~torch.isnan(stats.share)]
    n = int(stats.agree.numel())
    return {
        "positions": n,
        "agreement": float(stats.agree.double().mean()) if n else math.nan,
        "full_ce": float(stats.full_nll[labelled].mean()) if bool(labelled.any()) else math.nan,
        "path_ce": float(stats.path_nll[labelled].mean()) if bool(labelled.any()) else math.nan,
        "kl": float(stats.kl.mean()) if n else math.nan,
        "margin_share_median": float(share.quantile(0.5)) if share.numel() else math.nan,
        "carried_fraction": float((share >= CARRIES).double().mean()) if share.numel() else math.nan,
    }


def carried_share(top, other) -> float:
    """The prototypes' share of the choice of `top` over `other` at one position, from their two Decompositions
    (prism.model.Decomposition, same position and forward): (sum of top's slices - sum of other's) over
    (top's logit - other's). The residual's share is 1 - this. nan when the two logits are equal."""
    if top.position != other.position:
        raise ValueError(f"the two decompositions are at positions {top.position} and {other.position}")
    margin = top.logit - other.logit
    if margin == 0:
        return math.nan
    return (sum(top.contributions) - sum(other.contributions)) / margin


@dataclass
class Carried:
    """How much of the choice of a token over the runner-up (the highest-logit other token) the prototypes carry,
    carried_share of their two decompositions; the residual (W r + b) carries the rest. Above 1 or below 0 when
    the two parts pull opposite ways."""

    runner_up_id: int
    runner_up: str  # the runner-up token's text
    prototypes: float  # share of the logit gap carried by the prototypes' slices
    gap: float  # logit(token) - logit(runner-up); negative when a sampled token was not the top one

    @classmethod
    def of(cls, top, other, other_text: str) -> Carried | None:
        share = carried_share(top, other)
        if math.isnan(share):
            return None
        return cls(runner_up_id=other.token_id, runner_up=other_text, prototypes=share, gap=top.logit - other.logit)

    @property
    def residual(self) -> float:
        return 1.0 - self.prototypes

    @property
    def residual_decides(self) -> bool:
        return self.prototypes < CARRIES

    def as_dict(self) -> dict:
        return {"runner_up_id": self.runner_up_id, "runner_up": self.runner_up, "gap": self.gap,
                "prototypes": self.prototypes, "residual": self.residual, "residual_decides": self.residual_decides}


@dataclass
class Diff:
    """Token-by-token comparison of two continuations of the same prompt and seed."""

    status: list[str]  # per intervened token: same | first change | changed | after change
    first_change: int | None  # index of the first differing token

    def changed(self, index: int) -> bool:
        return self.status[index] in ("first change", "changed")


def token_diff(original: list[int], intervened: list[int]) -> Diff:
    """Per intervened token: 'same' before the first difference, 'first change' there, then 'changed' where the
    tokens at the same index differ and 'after change' where they agree again (the texts before them differ)."""
    a, b = original, intervened
    first = next((i for i in range(len(b)) if i >= len(a) or a[i] != b[i]), None)
    status = []
    for i, token in enumerate(b):
        if first is None or i < first:
            status.append("same")
        elif i == first:
            status.append("first change")
        else:
            status.append("changed" if i >= len(a) or a[i] != token else "after change")
    return Diff(status=status, first_change=first)


# ----------------------------------------------------------------------------------------------------------------
# One position explained: alternatives, the contrast of two tokens, what an intervention changed.


@dataclass
class Contrast:
    """Why token a and not token b at one position: margin = logit(a) - logit(b) = residual + sum(contributions)
    exactly. contributions[i] = a_i (W_a - W_b) . p_i for each active prototype (positive: favours a), ordered by
    size, largest first; residual = (W_a - W_b) . r + (b_a - b_b)."""

    token_a: int
    token_b: int
    position: int
    margin: float
    residual: float
    prototype_ids: list[int]
    contributions: list[float]

    @property
    def prototypes(self) -> float:
        """The prototypes' part of the margin (the residual's is `residual`)."""
        return float(sum(self.contributions))

    @property
    def share(self) -> float:
        """The prototypes' share of the margin, carried_share's number; nan when the logits tie."""
        return self.prototypes / self.margin if self.margin else math.nan

    def favouring(self, token: str = "a") -> list[tuple[int, float]]:
        """(prototype id, part) of the prototypes that favour token a (or b), strongest first."""
        sign = 1 if token == "a" else -1
        return [(p, c) for p, c in zip(self.prototype_ids, self.contributions) if sign * c > 0]

    def as_dict(self) -> dict:
        return {"token_a": self.token_a, "token_b": self.token_b, "position": self.position, "margin": self.margin,
                "residual": self.residual, "prototypes": self.prototypes, "share": self.share,
                "parts": [{"prototype_id": p, "contribution": c}
                          for p, c in zip(self.prototype_ids, self.contributions)]}


def contrast(a: Decomposition, b: Decomposition) -> Contrast:
    """The contrast of two tokens from their Decompositions at one position of one forward (decompose_output):
    both hold the same prototypes in the same order, so the parts are differences of their slices."""
    if a.position != b.position or a.prototype_ids != b.prototype_ids:
        raise ValueError("contrast takes two decompositions of the same position and forward")
    parts = [ca - cb for ca, cb in zip(a.contributions, b.contributions)]
    order = sorted(range(len(parts)), key=lambda i: -abs(parts[i]))
    return Contrast(token_a=a.token_id, token_b=b.token_id, position=a.position, margin=a.logit - b.logit,
                    residual=a.residual - b.residual, prototype_ids=[a.prototype_ids[i] for i in order],
                    contributions=[parts[i] for i in order])


@torch.no_grad()
def contrast_tokens(model: PrismForCausalLM, z: torch.Tensor, token_a: int, token_b: int,
                    interventions: Interventions | None = None) -> Contrast:
    """The contrast of any two tokens at the state z (d,): one head pass, both decomposed from it."""
    out = model.head(z.reshape(1, 1, -1), interventions)
    a, b = model.decompose_output(out, 0, [int(token_a), int(token_b)])
    return contrast(a, b)


@torch.no_grad()
def logit_attrs(model: PrismForCausalLM, z: torch.Tensor, token_ids: list[int] | torch.Tensor,
                interventions: Interventions | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensor-valued decomposition at one state z (d,): (slices (n, K), residual (n,)) for n tokens, where
    slices[j, i] = a_i (W p_i)[token j] for the prototypes the logits use (0 elsewhere) and residual[j] =
    (W r + b)[token j]; slices.sum(-1) + residual equals the logits (as TransformerLens's logit_attrs, per
    prototype instead of per component)."""
    out = model.head(z.reshape(1, 1, -1), interventions)
    ids, acts = (out.prototype_ids, out.activations) if out.used_prototype_ids is None else \
        (out.used_prototype_ids, out.used_activations)
    ids, acts = ids[0, 0], acts[0, 0]  # (k,)
    rows = model.lm_head.weight[torch.as_tensor(token_ids, dtype=torch.long)]  # (n, d)
    per = (rows @ model.prototypes.weight[ids].T) * acts  # (n, k)
    slices = torch.zeros(rows.shape[0], model.config.n_prototypes, dtype=per.dtype)
    slices.index_add_(1, ids, per)  # a prototype listed twice (injected and selected) adds up
    residual = rows @ out.residual[0, 0]
    if model.lm_head.bias is not None:
        residual = residual + model.lm_head.bias[torch.as_tensor(token_ids, dtype=torch.long)]
    return slices, residual


@dataclass
class Change:
    """What the interventions changed at one position of an intervened text, against the model without them.

    kind: "same" (before the first difference: nothing changed here), "indirect" (without the interventions the
    model writes the same token here; it differs because the text before it differs) or "direct". reference: the
    token the model writes without the interventions (direct only). effects: every prototype whose activation
    differs here, own or brought in by re-routing, with its effect on logit(new) - logit(reference), largest
    first; they add up exactly to the change of that margin. flip_set: the shortest run of the strongest
    intervened prototypes whose intervention alone makes the greedy choice stop being the reference (empty when
    none does). replacing: the prototypes re-routing brought in, with their activation."""

    kind: str
    new: int
    reference: int | None = None
    effects: list[tuple[int, float]] = field(default_factory=list)
    flip_set: list[int] = field(default_factory=list)
    replacing: dict[int, float] = field(default_factory=dict)


@torch.no_grad()
def explain_change(model: PrismForCausalLM, z: torch.Tensor, interventions: Interventions, new: int,
                   reference: int) -> Change:
    """The effects, flip set and replacements at state z (d,) for the intervened choice `new` against `reference`.
    z' - z = sum_p (a'_p - a_p) p_p exactly, so the effects add up to the change of logit(new) - logit(ref)."""
    z = z.reshape(1, 1, -1)
    plain = model.head(z)
    ids, acts = plain.prototype_ids[0, 0], plain.activations[0, 0]  # (k,) the model's own
    used = model.head(z, interventions)
    new_ids, new_acts = used.used_prototype_ids[0, 0], used.used_activations[0, 0]  # (k',) what it used
    change: dict[int, float] = {}
    for pid, a in zip(ids.tolist(), acts.tolist()):
        change[pid] = change.get(pid, 0.0) - a
    for pid, a in zip(new_ids.tolist(), new_acts.tolist()):
        change[pid] = change.get(pid, 0.0) + a
    moved = torch.tensor([p for p, c in change.items() if c != 0], dtype=torch.long)
    rows = model.lm_head.weight[[new, reference]]  # (2, d)
    signature = rows @ model.prototypes.weight[moved].T  # (2, n)
    effects = {p: change[p] * float(signature[0, n] - signature[1, n]) for n, p in enumerate(moved.tolist())}
    _, replacing = changed_selection(ids, acts, new_ids, new_acts)
    ordered = sorted(effects, key=lambda p: -effects[p])

    def writes_reference(subset: set[int]) -> bool:
        return int(model.head(z, restrict(interventions, subset)).logits[0, 0].argmax()) == reference

    flip_set: list[int] = []
    for pid in (p for p in ordered if p not in replacing):  # only what the user intervened on can be undone
        if effects[pid] <= 0:
            break
        flip_set.append(pid)
        if not writes_reference(set(flip_set)):
            break
    else:
        flip_set = []
    if flip_set and writes_reference(set(flip_set)):
        flip_set = []
    return Change(kind="direct", new=new, reference=reference, effects=[(p, effects[p]) for p in ordered],
                  flip_set=flip_set, replacing={p: float(new_acts[new_ids == p].sum()) for p in replacing})


@dataclass
class TokenExplanation:
    """One chosen token at one position: its decomposition, the top alternatives (chosen included, by logit), the
    share of the choice over the runner-up that the prototypes carry (None on a tie or without alternatives) and,
    for a token of an intervened text explained against the original, what the interventions changed."""

    chosen: Decomposition
    alternatives: list[Decomposition]
    carried: Carried | None
    change: Change | None = None
    probabilities: dict[int, float] = field(default_factory=dict)  # softmax of the position's logits, per token

    @property
    def runner_up(self) -> Decomposition | None:
        return next((d for d in self.alternatives if d.token_id != self.chosen.token_id), None)


@torch.no_grad()
def explain_token(model: PrismForCausalLM, z: torch.Tensor, token_id: int, interventions: Interventions | None = None,
                  n_alternatives: int = 5, against: tuple[list[int], list[int], int] | None = None,
                  decode=None) -> TokenExplanation:
    """Everything a click on one token shows, from the state z (d,) at the position that chose it.

    against = (original token ids, intervened token ids, index of this token in the intervened text) asks what the
    interventions changed here (Change): the reference is the original token at the first difference (when the
    original reaches that far), else the plain model's top token after the intervened prefix. decode(token_id) ->
    text names the runner-up in `carried` (token ids are shown without it)."""
    interventions = interventions or Interventions()
    out = model.head(z.reshape(1, 1, -1), interventions)
    logits = out.logits[0, 0]  # (V,)
    top = [int(t) for t in logits.topk(min(n_alternatives, logits.shape[0])).indices]
    tokens = sorted([token_id] + [t for t in top if t != token_id], key=lambda t: -float(logits[t]))
    decs = model.decompose_output(out, 0, tokens)
    chosen = next(d for d in decs if d.token_id == token_id)
    runner = next((d for d in decs if d.token_id != token_id), None)  # decs are in logit order
    carried = runner and Carried.of(chosen, runner, decode(runner.token_id) if decode else str(runner.token_id))
    change = None
    if against is not None:
        original, intervened, index = against
        diff = token_diff(original, intervened)
        if diff.first_change is None or index < diff.first_change:
            change = Change(kind="same", new=token_id)
        else:
            reference = original[index] if index == diff.first_change and index < len(original) else \
                int(model.head(z.reshape(1, 1, -1)).logits[0, 0].argmax())  # (the original may have ended)
            change = Change(kind="indirect", new=token_id) if reference == token_id else \
                explain_change(model, z, interventions, token_id, reference)
    probs = logits.float().softmax(-1)
    return TokenExplanation(chosen=chosen, alternatives=decs, carried=carried or None, change=change,
                            probabilities={t: float(probs[t]) for t in tokens})


@torch.no_grad()
def pushers(model: PrismForCausalLM, token_id: int, top: int = 20) -> list[tuple[int, float]]:
    """"Who pushes token X": the prototypes whose signature most raises token_id, (id, (W p_i)[token]) strongest
    first: the slice each would add to the token's logit at activation 1 (a slice is activation x this)."""
    if not 0 <= int(token_id) < model.lm_head.weight.shape[0]:
        raise ValueError(f"token_id {token_id} is outside the vocabulary of {model.lm_head.weight.shape[0]} tokens")
    values = model.prototypes.weight @ model.lm_head.weight[int(token_id)]  # (K,)
    order = values.argsort(descending=True)[:top]
    return [(int(i), float(values[i])) for i in order]
