"""One user's generations as values: the settings, each generated token with the prototypes that produced it, and
the comparison of two texts. Immutable: app/core.py's Studio.stream yields a new Generation per token, so a session
(app/session.py) holds them without copying.

    gen.text, gen.token_ids, gen.steps[3].prototype_ids
    side_by_side(original, intervened).first_change      # prism.explain.Diff
    rerouted_summary(intervened)                         # who re-routing brought in most often
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prism import Interventions
from prism.explain import Diff, token_diff


@dataclass(frozen=True)
class GenerationSettings:
    prompt: str
    max_new_tokens: int = 24
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0

    @property
    def do_sample(self) -> bool:
        return self.temperature > 0


@dataclass(frozen=True)
class Step:
    """One generated token and the prototypes that produced it (effective, after interventions)."""

    token_id: int
    text: str
    prototype_ids: list[int]  # ordered by activation, only those > 0
    activations: list[float]
    logit: float  # the logit of the token in the distribution it was chosen from
    rerouted_ids: list[int] = field(default_factory=list)  # prototypes that re-routing brought in at this token
    # (d,) z at the position that chose the token, from the generation's own forward (kept for the first
    # limits.keep_states_tokens tokens): a click decomposes it without running the model again
    state: torch.Tensor | None = field(default=None, repr=False, compare=False)
    # (t, d) the states entering the trained layers at the positions this step's forward read (the first step: the
    # prompt; later ones: the token before), kept as `state` is: a gradient click skips the frozen layers
    layer_states: torch.Tensor | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True, eq=False)  # compared by identity: two runs with equal tokens are still two generations
class Generation:
    settings: GenerationSettings
    interventions: Interventions
    prompt_ids: tuple[int, ...]
    prompt_text: str
    steps: tuple[Step, ...] = ()
    notes: tuple[str, ...] = ()  # e.g. the prompt was truncated
    finished: bool = False  # True once generation ended (end of text or max new tokens), False while streaming

    @property
    def token_ids(self) -> list[int]:
        return [s.token_id for s in self.steps]

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.steps)

    def input_ids(self, upto: int | None = None) -> torch.Tensor:
        """prompt + generated tokens [:upto], (1, T)."""
        return torch.tensor([list(self.prompt_ids) + self.token_ids[:upto]])

    def layer_states(self) -> torch.Tensor | None:
        """(1, T - 1, d): the states entering the trained layers at every position of prompt + tokens[:-1], as the
        generation computed them (Step.layer_states); None where a step did not keep them."""
        parts = [s.layer_states for s in self.steps]
        if not parts or any(p is None for p in parts):
            return None
        return torch.cat(parts)[None]


def side_by_side(original: Generation, intervened: Generation) -> Diff:
    """The intervened text's tokens against the original's (prism.explain.token_diff)."""
    return token_diff(original.token_ids, intervened.token_ids)


def rerouted_summary(gen: Generation, top: int = 5) -> list[tuple[int, int]]:
    """[(prototype_id, number of tokens)] of the prototypes re-routing brought in most often in a generation."""
    counts: dict[int, int] = {}
    for step in gen.steps:
        for pid in step.rerouted_ids:
            counts[pid] = counts.get(pid, 0) + 1
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top]


def never_active(gen: Generation, prototype_ids) -> list[int]:
    """Those of prototype_ids that no generated token of gen used (a scaled prototype the text never reached)."""
    used = {pid for step in gen.steps for pid in step.prototype_ids}
    return sorted(int(p) for p in prototype_ids if int(p) not in used)


def same_settings(gen: Generation | None, settings: GenerationSettings) -> bool:
    return gen is not None and gen.settings == settings
