"""Interventions: plain values passed with a call, validated against the bank, never stored on the model
(docs/DESIGN.md section 3). The model applies them in prism/model.py (select, effective_activations); this module
holds the values and the small helpers that read them.

    iv = Interventions(suppress={3, 7}, scale={12: 2.0}, suppress_mode="reroute")
    iv.check(model.config.n_prototypes)        # ValueError for an id the bank does not have
    restrict(iv, {3, 12})                      # only what concerns prototypes 3 and 12
    changed_selection(own_ids, own_acts, used_ids, used_acts)   # (switched off, brought in by re-routing)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class ActivationController(Protocol):
    """A fitted map from a position's active-prototype activations to new ones (docs/DESIGN.md section 3, controllers;
    prism/controllers.py has the fitted kind). reweight must keep the ids, keep activations >= 0 and act on each
    position on its own, so it works inside cached generation like the other interventions."""

    n_prototypes: int

    def reweight(self, ids: torch.Tensor, acts: torch.Tensor) -> torch.Tensor:
        """ids (..., k) long, acts (..., k) >= 0 -> new activations (..., k) >= 0."""
        ...

    def restricted(self, prototype_ids: set[int]) -> ActivationController:
        """The same controller acting only on prototype_ids (every other prototype left as it is)."""
        ...


SUPPRESS_MODES = ("zero", "reroute")


@dataclass(frozen=True)
class Interventions:
    """Changes to prototype activations for one call (docs/DESIGN.md section 3).

    suppress: prototype ids switched off at every position, in one of two ways (suppress_mode):
              "zero"    (the default) their activation is set to 0 where they are active: exactly their slices
                        leave the logits, z' = z - sum_{i in S} a_i p_i, and nothing takes their place;
              "reroute" they are masked out of the top-k selection: the position takes the top-k of the
                        similarities outside the set, z' = r + sum_{j in K'} a_j p_j with r the position's own
                        residual, so the nearest other prototypes explain it.
    controller: a fitted ActivationController, applied to the selection (the model's own top-k; with "reroute"
              the re-routed top-k, so it sees the replacements as ordinary active prototypes).
    scale:    {prototype_id: factor >= 0} multiplies the activation wherever the prototype is in the selection
              (with "reroute" a replacement can be scaled too).
    inject:   {prototype_id: activation >= 0} sets the activation at every position, selected there or not.
    Order: selection (re-routed or not), controller, suppress (zeroed; a no-op after re-routing unless the bank has
    fewer than k prototypes outside the set), scale, inject. A prototype may appear in only one of
    suppress/scale/inject.
    """

    suppress: frozenset[int] = field(default_factory=frozenset)
    scale: dict[int, float] = field(default_factory=dict)
    inject: dict[int, float] = field(default_factory=dict)
    controller: ActivationController | None = None
    suppress_mode: str = "zero"

    def __post_init__(self) -> None:
        if self.suppress_mode not in SUPPRESS_MODES:
            raise ValueError(f"suppress_mode must be one of {', '.join(map(repr, SUPPRESS_MODES))} (remove the "
                             f"slices, or re-route to the nearest other prototypes), got {self.suppress_mode!r}")
        if self.controller is not None and not isinstance(self.controller, ActivationController):
            raise TypeError(f"controller must be an ActivationController (n_prototypes, reweight, restricted), got "
                            f"{type(self.controller).__name__}")
        object.__setattr__(self, "suppress", frozenset(int(i) for i in self.suppress))
        object.__setattr__(self, "scale", {int(i): float(s) for i, s in self.scale.items()})
        object.__setattr__(self, "inject", {int(i): float(a) for i, a in self.inject.items()})
        for name, values in (("scale factor", self.scale), ("injected activation", self.inject)):
            for i, v in values.items():
                if not math.isfinite(v) or v < 0:
                    raise ValueError(f"{name} for prototype {i} must be finite and >= 0 (activations stay "
                                     f"non-negative), got {v}")
        groups = [set(self.suppress), set(self.scale), set(self.inject)]
        clash = (groups[0] & groups[1]) | (groups[0] & groups[2]) | (groups[1] & groups[2])
        if clash:
            raise ValueError(f"prototypes {sorted(clash)} appear in more than one of suppress/scale/inject")

    @property
    def is_empty(self) -> bool:
        return not (self.suppress or self.scale or self.inject or self.controller is not None)

    @property
    def reroutes(self) -> bool:
        """Whether this call changes the top-k selection itself (reroute mode with something suppressed)."""
        return self.suppress_mode == "reroute" and bool(self.suppress)

    def prototype_ids(self) -> set[int]:
        """The prototypes named in suppress/scale/inject (a controller may move any active prototype)."""
        return set(self.suppress) | set(self.scale) | set(self.inject)

    def check(self, n_prototypes: int) -> None:
        bad = sorted(i for i in self.prototype_ids() if not 0 <= i < n_prototypes)
        if bad:
            raise ValueError(f"unknown prototype ids {bad}: this model has prototypes 0..{n_prototypes - 1}")
        if self.controller is not None and self.controller.n_prototypes != n_prototypes:
            raise ValueError(f"the controller was fitted for a model with {self.controller.n_prototypes} prototypes "
                             f"but this model has {n_prototypes}: it belongs to another model")


def restrict(interventions: Interventions, ids: set[int]) -> Interventions:
    """The part of `interventions` that concerns the prototypes in ids (a controller's part included)."""
    controller = interventions.controller
    return Interventions(suppress=frozenset(interventions.suppress & ids),
                         scale={p: f for p, f in interventions.scale.items() if p in ids},
                         inject={p: a for p, a in interventions.inject.items() if p in ids},
                         controller=None if controller is None else controller.restricted(ids),
                         suppress_mode=interventions.suppress_mode)


def changed_selection(own_ids: torch.Tensor, own_acts: torch.Tensor, used_ids: torch.Tensor,
                       used_acts: torch.Tensor) -> tuple[list[int], list[int]]:
    """At one position: (the model's own active prototypes the logits no longer use, the prototypes that entered
    the selection in their place). own (k,), used (k',): the first k used entries are the (re-routed) selection,
    injected ones follow and are not counted as replacements."""
    k = own_ids.shape[0]
    own = {int(i) for i, a in zip(own_ids.tolist(), own_acts.tolist()) if a > 0}
    used = {int(i) for i, a in zip(used_ids.tolist(), used_acts.tolist()) if a > 0}
    selected = {int(i) for i, a in zip(used_ids[:k].tolist(), used_acts[:k].tolist()) if a > 0}
    return sorted(own - used), sorted(selected - {int(i) for i in own_ids.tolist()})
