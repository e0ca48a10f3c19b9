"""The app's logic without any UI: generation with per-token explanations, read from one user's texts. The
explanation itself (decomposition, alternatives, contrast, what an intervention changed) is prism/explain.py; the
database is app/database.py; the Gradio layer (app/ui.py, app/handlers.py) only formats what this returns.

    studio = Studio.load("runs/m", db="out.duckdb")      # model and database shared read-only by all users
    settings = GenerationSettings("The river flows into the", max_new_tokens=20)
    for gen in studio.stream(settings, Interventions()):  # a new, longer Generation after every token
        ...
    view = studio.explain(gen, index=3)                   # token 3: decomposition, alternatives, carried share
    view = studio.explain(intervened, 3, original=gen)    # ... and what the interventions changed there (view.why)
    diff = side_by_side(original, intervened)             # per-token status, first divergence

Values are immutable: stream() yields a new Generation per token, never changing one it yielded, so a session
(app/session.py) can hold them. Generation keeps per step what model.stream() returns (token, effective prototypes
and activations, the chosen logit, z for the first limits.keep_states_tokens tokens); a later token needs one forward
pass over the text, kept beside the generation while it lives (bench/app_latency.py measures both).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import duckdb
import torch

from app import limits
from app.database import NEVER_ACTIVE, UNLABELLED, Database, check_prototype, filters  # noqa: F401 (re-exported)
from app.errors import AppError
from app.generation import (  # noqa: F401 (re-exported: the app's values live there)
    Generation,
    GenerationSettings,
    Step,
    rerouted_summary,
    same_settings,
    side_by_side,
)
from app.limits import CostBudget, Limits
from prism import Interventions, PrismForCausalLM, explain
from prism.backbones import load_tokenizer
from prism.explain import Carried, Change, explain_token
from prism.grad_cache import trained_start_layer
from prism.interventions import changed_selection, restrict  # noqa: F401 (restrict re-exported for the app)

logger = logging.getLogger(__name__)

NO_PROTOTYPE = "no prototype active"  # a token's colour when no prototype fired for it (not a category)
MAX_TEMPERATURE = 2.0
MAX_SEED = 2**32 - 1  # torch and numpy both take seeds in this range
BUILD_HINT = ("No precompute database is loaded, so there are no labels, categories or evidence. Build one with "
              "`python -m precompute build --model MODEL --corpus CORPUS --db out.duckdb` and start the app with "
              "`--db out.duckdb`.")


# ----------------------------------------------------------------------------------------------------------------
# Values: one token's view (the generation's values are app/generation.py).


@dataclass
class Slice:
    prototype_id: int
    label: str
    category: str
    activation: float
    contribution: float


@dataclass
class TokenDecomposition:
    """A token's logit as residual + one slice per active prototype; total is their exact sum."""

    token_id: int
    token: str
    logit: float  # the model's logit (the forward pass of the whole text)
    residual: float
    slices: list[Slice]
    removed_ids: list[int] = field(default_factory=list)  # own active prototypes the interventions switched off
    rerouted_ids: list[int] = field(default_factory=list)  # the prototypes re-routing brought in in their place
    probability: float | None = None  # softmax of the position's logits (the distribution it was chosen from)

    @property
    def total(self) -> float:
        return self.residual + sum(s.contribution for s in self.slices)

    def as_dict(self) -> dict:
        return {"token_id": self.token_id, "token": self.token, "logit": self.logit, "probability": self.probability,
                "residual": self.residual, "sum": self.total, "slices": [s.__dict__ for s in self.slices],
                "removed_ids": self.removed_ids, "rerouted_ids": self.rerouted_ids}


@dataclass
class WhyChanged:
    """Why the intervened text has token `new` where `reference` would have been written (prism.explain.Change,
    with labels and a sentence)."""

    index: int
    new_token: str
    reference_token: str | None  # None: the intervention did not change this token directly
    message: str
    effects: list[dict]  # per prototype whose activation changed here (intervened, or a replacement that
    #                      re-routing brought in): id, label, role, effect on logit(new) - logit(ref); they add up
    flip_set: list[int]  # the smallest leading set of intervened prototypes whose intervention alone flips it
    replacements: list[dict] = field(default_factory=list)  # re-routing: who took the suppressed slots, and effect

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Target:
    """The token a click means (Studio.target): its index, the position whose logits scored it, its id."""

    index: int  # generated-token index, or the prompt token's index in the prompt
    position: int  # sequence position whose logits chose (predicted) it
    token_id: int
    stream_logit: float | None  # the logit generation chose it from; None for a prompt token
    in_prompt: bool


@dataclass
class TokenView:
    index: int  # generated-token index (a prompt token's index in the prompt when in_prompt)
    position: int  # sequence position whose logits chose (or, for a prompt token, predicted) the token
    chosen: TokenDecomposition
    alternatives: list[TokenDecomposition]  # the top tokens at that position, chosen one included, by logit
    stream_logit: float | None  # the logit stream() chose the token from (KV-cached; equal up to float noise);
    #                             None for a prompt token, which no generation chose
    carried: Carried | None = None  # None when the two logits tie (no choice to share out)
    why: WhyChanged | None = None  # for a token of an intervened text explained against the original
    in_prompt: bool = False  # a token of the prompt: what the model expected there, from the text before it

    def as_dict(self) -> dict:
        return {"index": self.index, "position": self.position, "in_prompt": self.in_prompt,
                "stream_logit": self.stream_logit,
                "chosen": self.chosen.as_dict(), "alternatives": [a.as_dict() for a in self.alternatives],
                "carried": self.carried.as_dict() if self.carried else None}


# ----------------------------------------------------------------------------------------------------------------
# The studio: model, tokenizer and database, shared read-only by every user.


class Studio:
    def __init__(self, model: PrismForCausalLM, tokenizer, db: Database | None = None,
                 db_error: str | None = None, limits: Limits | None = None) -> None:
        self.model = model.eval()
        self.limits = limits or Limits()
        self.budget = CostBudget(self.limits)  # per session hash: admission of generations by their cost
        self.tokenizer = tokenizer
        self.db = db
        self.db_error = db_error
        self.n_prototypes = model.config.n_prototypes
        # Generation ends at the tokenizer's end-of-text and other special tokens (none is ever shown as text).
        self.stop_ids = frozenset(int(i) for i in tokenizer.all_special_ids)
        # final states of texts past limits.keep_states_tokens steps, kept beside their generation while it lives
        self._states: weakref.WeakKeyDictionary[Generation, torch.Tensor] = weakref.WeakKeyDictionary()
        self._states_lock = threading.Lock()
        # the first trained decoder layer: generation keeps the states entering it, a gradient query's input
        self.start_layer = trained_start_layer(model)
        if db is not None and len(db.labels) != self.n_prototypes:
            self.db_error = (f"{db.path} describes {len(db.labels)} prototypes but the model has "
                             f"{self.n_prototypes}: it was built for another model, so it is not used")
            logger.warning(self.db_error)
            db.close()
            self.db = None

    @classmethod
    def load(cls, model_path: str | Path, db: str | Path | None = None, limits: Limits | None = None) -> Studio:
        model = PrismForCausalLM.from_pretrained(model_path).eval()
        tokenizer = load_tokenizer(str(model_path))
        database, error = None, None
        if db is not None:
            try:
                database = Database(db)
            except (FileNotFoundError, ValueError, duckdb.Error) as err:
                error = f"the database could not be opened ({err}); running without it"
                logger.warning(error)
        return cls(model, tokenizer, database, error, limits)

    # -- labels and the database ------------------------------------------------------------------------------

    def label(self, prototype_id: int) -> tuple[str, str]:
        """(label, category) of a prototype; ("", "unlabelled") without a database."""
        if self.db is None:
            return "", UNLABELLED
        return self.db.labels.get(int(prototype_id), ("", UNLABELLED))

    def check_prototype(self, prototype_id) -> int:
        return check_prototype(prototype_id, self.n_prototypes)

    def need_db(self) -> Database:
        """The database, or AppError saying how to build one."""
        if self.db is None:
            raise AppError(BUILD_HINT if self.db_error is None else f"{self.db_error}. {BUILD_HINT}")
        return self.db

    def filters(self) -> list[str]:
        """The browser's category filter (app/database.py filters), with or without a database."""
        return filters(self.db)

    def presets(self) -> list[dict]:
        """The database's presets, [] without one."""
        return self.db.presets() if self.db is not None else []

    # -- generation -------------------------------------------------------------------------------------------

    def check_settings(self, settings: GenerationSettings) -> GenerationSettings:
        """The settings if this app runs them (lengths within its limits, numbers finite and in range); AppError
        with a short message otherwise. Every way in (the page, the API, a link) goes through here."""
        lim = self.limits
        prompt = limits.text("the prompt", settings.prompt, lim.max_prompt_chars)
        if not prompt.strip():
            raise AppError("the prompt is empty: type a few words for the model to continue")
        max_new = limits.whole("max new tokens", settings.max_new_tokens, 1, lim.max_new_tokens)
        temperature = limits.number("temperature", settings.temperature, 0, MAX_TEMPERATURE, default=0)
        top_p = limits.number("top-p", settings.top_p, 0, 1, default=1)
        if top_p <= 0:
            raise AppError("top-p must be above 0 (1 keeps every token)")
        seed = limits.whole("the seed", settings.seed, 0, MAX_SEED, default=0)
        return GenerationSettings(prompt=prompt, max_new_tokens=max_new, temperature=temperature, top_p=top_p,
                                  seed=seed)

    def encode_prompt(self, settings: GenerationSettings) -> tuple[list[int], int, list[str]]:
        """Prompt ids, the number of new tokens that fit, and notes for the user (truncation)."""
        settings = self.check_settings(settings)
        ids = self.tokenizer(settings.prompt, add_special_tokens=False)["input_ids"]
        if not ids:
            raise AppError("the prompt has no tokens")
        if len(ids) > self.limits.max_prompt_tokens:
            raise AppError(f"the prompt has {len(ids):,} tokens; this app takes at most "
                           f"{self.limits.max_prompt_tokens:,}: shorten it")
        notes = []
        max_new = int(settings.max_new_tokens)
        limit = self.model.max_length
        if limit is not None:
            if max_new >= limit:
                max_new = limit // 2
                notes.append(f"max new tokens lowered to {max_new}: the model's context is {limit} tokens")
            room = limit - max_new
            if len(ids) > room:
                notes.append(f"the prompt had {len(ids)} tokens; the model's context is {limit} tokens, so only "
                             f"its last {room} are used")
                ids = ids[-room:]
        return ids, max_new, notes

    def stream(self, settings: GenerationSettings, interventions: Interventions | None = None,
               ) -> Iterator[Generation]:
        """Generate with model.stream(), yielding a new, one token longer Generation after every token."""
        interventions = interventions or Interventions()
        try:
            interventions.check(self.n_prototypes)
        except ValueError as err:
            raise AppError(str(err)) from None
        settings = self.check_settings(settings)
        ids, max_new, notes = self.encode_prompt(settings)
        gen = Generation(settings=settings, interventions=interventions, prompt_ids=tuple(ids),
                         prompt_text=self.tokenizer.decode(ids), notes=tuple(notes))
        input_ids = torch.tensor([ids])  # (1, T)
        for step in self.model.stream(input_ids, max_new, interventions=interventions,
                                      do_sample=settings.do_sample, temperature=settings.temperature or 1.0,
                                      top_p=settings.top_p, seed=settings.seed,
                                      keep_states_before=self.start_layer):
            token = int(step.token_ids[0])
            if token in self.stop_ids:  # end of text: stop there, and never show a special token as text
                yield replace(gen, finished=True,
                              notes=(*gen.notes, f"the model ended the text after {len(gen.steps)} token(s)"))
                return
            rerouted: list[int] = []
            if step.used_prototype_ids is None:
                pids, acts = step.prototype_ids[0], step.activations[0]
            else:
                pids, acts = step.used_prototype_ids[0], step.used_activations[0]  # (k',) what the logits used
                _, rerouted = changed_selection(step.prototype_ids[0], step.activations[0], pids, acts)
            keep = acts > 0
            pids, acts = pids[keep], acts[keep]
            order = acts.argsort(descending=True)
            kept = step.state is not None and len(gen.steps) < self.limits.keep_states_tokens
            new = Step(token_id=token, text=self.tokenizer.decode([token]), prototype_ids=pids[order].tolist(),
                       activations=acts[order].tolist(), logit=float(step.logits[0, token]), rerouted_ids=rerouted,
                       state=step.state[0].clone() if kept else None,
                       layer_states=step.layer_states[0].clone() if kept and step.layer_states is not None
                       else None)
            gen = replace(gen, steps=(*gen.steps, new), finished=len(gen.steps) + 1 == max_new)
            yield gen

    def generate(self, settings: GenerationSettings, interventions: Interventions | None = None) -> Generation:
        *_, gen = self.stream(settings, interventions)  # the last value is the whole text
        return gen

    def top_category(self, step: Step) -> str:
        return self.label(step.prototype_ids[0])[1] if step.prototype_ids else NO_PROTOTYPE

    # -- one token explained ----------------------------------------------------------------------------------

    @torch.no_grad()
    def final_states(self, gen: Generation) -> torch.Tensor:
        """z (T, d) for prompt + tokens[:-1] (one forward pass). Kept beside the generation while it is at most
        limits.keep_states_tokens long, so the next click is fast; a longer one is recomputed on every click, so a
        session never holds more than that many states per text."""
        n = len(gen.prompt_ids) + len(gen.steps) - 1
        with self._states_lock:
            z = self._states.get(gen)
        if z is not None and z.shape[0] >= n:
            return z
        z = self.model.final_states(gen.input_ids(len(gen.steps) - 1))[0][0]
        if n <= self.limits.keep_states_tokens:
            with self._states_lock:
                self._states[gen] = z
        return z

    def state(self, gen: Generation, index: int, in_prompt: bool = False) -> torch.Tensor:
        """z (d,) at the position that chose generated token `index` (or predicted prompt token `index`): the
        state the generation itself computed when it was kept, else from one forward pass over the text
        (final_states). The same value up to float rounding (a cached forward vs a full one), so the slices still
        add up to the logit shown."""
        target = self.target(gen, index, in_prompt)
        state = None if in_prompt else gen.steps[target.index].state
        return state if state is not None else self.final_states(gen)[target.position]

    def token_position(self, gen: Generation, index) -> tuple[int, int]:
        """(generated-token index, the sequence position whose logits chose it); AppError for a bad index."""
        target = self.target(gen, index)
        return target.index, target.position

    def target(self, gen: Generation, index, in_prompt: bool = False) -> Target:
        """Which token a click means: generated token `index`, or with in_prompt the prompt's token `index`, which
        the model predicted from the prompt before it (so the first prompt token has no explanation); AppError
        with the valid range for a bad index."""
        index = limits.whole("the token index", index, -2**31, 2**31)
        if not in_prompt:
            if not 0 <= index < len(gen.steps):
                raise AppError(f"there is no generated token {index}: this text has {len(gen.steps)}")
            step = gen.steps[index]
            return Target(index, len(gen.prompt_ids) + index - 1, step.token_id, step.logit, False)
        n = len(gen.prompt_ids)
        if n < 2:
            raise AppError("the prompt is one token: no text comes before it to predict it from")
        if index == 0:
            raise AppError(f"prompt token 0 is the first: no text comes before it to predict it from "
                           f"(explain prompt tokens 1 to {n - 1})")
        if not 0 < index < n:
            raise AppError(f"there is no prompt token {index}: the prompt has {n} tokens (explain 1 to {n - 1})")
        return Target(index, index - 1, gen.prompt_ids[index], None, True)

    def explain(self, gen: Generation, index, original: Generation | None = None,
                n_alternatives: int = 5, in_prompt: bool = False) -> TokenView:
        """Generated token `index` of gen explained by one call into the library (prism.explain.explain_token):
        its decomposition, the top alternatives, the share carried over the runner-up and, with `original` (gen
        then being the intervened text), why the interventions changed it (view.why). With in_prompt, the
        prompt's token `index`: the same split of the logit the model gave it after the prompt before it (under
        gen's interventions; no 'why it changed')."""
        target = self.target(gen, index, in_prompt)
        against = None if original is None or in_prompt else (original.token_ids, gen.token_ids, target.index)
        ex = explain_token(self.model, self.state(gen, target.index, in_prompt), target.token_id,
                           gen.interventions, n_alternatives, against=against, decode=self.decode)
        views = {d.token_id: replace(self._decomposition(d), probability=ex.probabilities.get(d.token_id))
                 for d in ex.alternatives}
        return TokenView(index=target.index, position=target.position, chosen=views[target.token_id],
                         alternatives=list(views.values()), stream_logit=target.stream_logit, carried=ex.carried,
                         why=None if ex.change is None else self._why(target.index, ex.change), in_prompt=in_prompt)

    def token_view(self, gen: Generation, index: int, n_alternatives: int = 5) -> TokenView:
        """Decomposition of generated token `index` and of the top alternatives at its position."""
        return self.explain(gen, index, n_alternatives=n_alternatives)

    def why_changed(self, original: Generation, intervened: Generation, index: int) -> WhyChanged:
        """Which of the intervened prototypes made the intervened text write token `index` (prism.explain.Change:
        the reference is what the model without interventions writes at the same place after the same text; the
        effects add up exactly to the change of logit(new) - logit(reference); the flip set is the shortest run of
        the strongest effects whose intervention alone makes the model stop writing the reference)."""
        return self.explain(intervened, index, original=original).why

    def token_of(self, text) -> tuple[int, str]:
        """The first token of a text a user typed, and a note when the text is more than one; AppError for none."""
        text = limits.text("the token", text, 200)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] if text.strip() else []
        if not ids:
            raise AppError("type a token, e.g. ' Paris' (with its leading space, as it follows a word)")
        return ids[0], "" if len(ids) == 1 else f"{text[:40]!r} is {len(ids)} tokens; using the first, " \
            f"{self.decode(ids[0])!r}"

    def pushers(self, text: str, top: int = 50) -> tuple[str, list[tuple[int, float]], str]:
        """Who pushes a token: (the token, [(prototype id, its slice at activation 1)] strongest first, a note)."""
        token, note = self.token_of(text)
        return self.decode(token), explain.pushers(self.model, token, top), note

    def contrast(self, gen: Generation, index, other, in_prompt: bool = False) -> tuple[explain.Contrast, str]:
        """Why generated token `index` (with in_prompt: prompt token `index`) and not the token `other` (text) at
        its position: prism.explain.Contrast (margin = residual + one part per prototype, exactly) and a note when
        `other` was several tokens."""
        target = self.target(gen, index, in_prompt)
        token, note = self.token_of(other)
        return explain.contrast_tokens(self.model, self.state(gen, target.index, in_prompt), target.token_id,
                                       token, gen.interventions), note

    @torch.no_grad()
    def signature_ends(self, prototype_id, n: int = 10) -> tuple[list[dict], list[dict]]:
        """A prototype's logit signature W p at both ends: the n tokens it raises most and the n it lowers most
        ([{token_id, token, value}], strongest first), from the model itself."""
        pid = self.check_prototype(prototype_id)
        values = self.model.lm_head.weight @ self.model.prototypes.weight[pid]
        ends = []
        for largest in (True, False):
            top = values.topk(min(n, values.shape[0]), largest=largest)
            ends.append([{"token_id": int(t), "token": self.decode(int(t)), "value": float(v)}
                         for v, t in zip(top.values, top.indices)])
        return ends[0], ends[1]

    @torch.no_grad()
    def activations_on(self, text, prototype_id) -> tuple[list[str], list[float]]:
        """"Try it on your text": the text's tokens and the prototype's activation at each (0 where the model does
        not select it), from one forward pass over the text as a prompt."""
        pid = self.check_prototype(prototype_id)
        text = limits.text("the text", text, self.limits.max_prompt_chars)
        ids, _, _ = self.encode_prompt(GenerationSettings(text, max_new_tokens=1))
        out = self.model(torch.tensor([ids]))
        acts = ((out.prototype_ids[0] == pid) * out.activations[0]).sum(-1)  # (T,)
        return [self.decode(i) for i in ids], [float(a) for a in acts]

    def decode(self, token_id: int) -> str:
        return self.tokenizer.decode([int(token_id)])

    def _decomposition(self, d) -> TokenDecomposition:
        slices = [Slice(pid, *self.label(pid), act, contribution)
                  for pid, act, contribution in zip(d.prototype_ids, d.activations, d.contributions)]
        return TokenDecomposition(token_id=d.token_id, token=self.decode(d.token_id), logit=d.logit,
                                  residual=d.residual, slices=slices, removed_ids=d.removed_ids,
                                  rerouted_ids=d.rerouted_ids)

    def _why(self, index: int, change: Change) -> WhyChanged:
        """A Change with labels and a sentence."""
        new = self.decode(change.new)
        if change.kind == "same":
            return WhyChanged(index, new, None, "this token is the same in both texts", [], [])
        if change.kind == "indirect":
            return WhyChanged(index, new, None, "the interventions did not change this token directly: without "
                              "them the model would write the same token here; it differs from the original "
                              "because the text before it differs", [], [])
        ref_text = self.decode(change.reference)
        if not change.effects:
            message = "no intervened prototype is active here"
        elif change.flip_set:
            message = (f"without the interventions the model writes {ref_text!r} here; intervening on "
                       f"{', '.join(f'#{p}' for p in change.flip_set)} alone is enough to change that")
        else:
            message = (f"without the interventions the model writes {ref_text!r} here; no subset of the "
                       "intervened prototypes flips the greedy choice on its own (the token was sampled)")
        if change.replacing:
            message += ("; the suppressed prototypes' slots were re-routed to "
                        + ", ".join(f"#{p} {self.label(p)[0]!r}".replace(" ''", "") for p in change.replacing))

        def describe(p: int, effect: float) -> dict:
            label, category = self.label(p)
            return {"prototype_id": p, "label": label, "category": category, "effect": effect,
                    "role": "replacement" if p in change.replacing else "intervened"}

        effects = dict(change.effects)
        return WhyChanged(index=index, new_token=new, reference_token=ref_text, message=message,
                          effects=[describe(p, e) for p, e in change.effects], flip_set=change.flip_set,
                          replacements=[describe(p, effects[p]) | {"activation": a}
                                        for p, a in change.replacing.items()])
