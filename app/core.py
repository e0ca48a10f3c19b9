"""The app's logic without any UI: generation with per-token decomposition, side-by-side diffs, "which prototypes
changed this token", cards, evidence and search. The Gradio layer (app/ui.py) only formats what this returns.

    studio = Studio.load("runs/m", db="out.duckdb")      # model and database shared read-only by all users
    settings = GenerationSettings("The river flows into the", max_new_tokens=20)
    for gen in studio.stream(settings, Interventions()):  # the growing Generation, one token at a time
        ...
    view = studio.token_view(gen, index=3)                # decomposition of token 3 and its top alternatives
    diff = side_by_side(original, intervened)             # per-token status, first divergence
    why = studio.why_changed(original, intervened, diff.first_change)

Cost: generation runs model.stream() and keeps per step only what it already returns (token, the effective
prototype ids and activations, the chosen logit). A token's full decomposition needs the residual, which
stream() does not yield, so the final states z of the whole text are computed by one forward pass the first time
a token of that generation is selected and kept with the generation (bench/app_latency.py measures both).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import torch

from app import limits
from app.database import UNLABELLED, Database
from app.errors import AppError
from app.limits import Limits
from precompute import query
from precompute.query import UnknownPrototype
from prism import Interventions, PrismForCausalLM
from prism.backbones import load_tokenizer
from prism.explain import Carried, Diff, token_diff
from prism.model import changed_selection

logger = logging.getLogger(__name__)

NO_PROTOTYPE = "no prototype active"  # a token's colour when no prototype fired for it (not a category)
NEVER_ACTIVE = "never active"  # a browser filter: prototypes with no activation in the corpus (dead)
MAX_QUERY_CHARS = 200
MAX_TEMPERATURE = 2.0
MAX_SEED = 2**32 - 1  # torch and numpy both take seeds in this range
BUILD_HINT = ("No precompute database is loaded, so there are no labels, categories or evidence. Build one with "
              "`python -m precompute build --model MODEL --corpus CORPUS --db out.duckdb` and start the app with "
              "`--db out.duckdb`.")


# ----------------------------------------------------------------------------------------------------------------
# Values: settings, one generation, one token's view.


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


@dataclass
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


@dataclass
class Generation:
    settings: GenerationSettings
    interventions: Interventions
    prompt_ids: list[int]
    prompt_text: str
    steps: list[Step] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # e.g. the prompt was truncated
    finished: bool = False  # True once generation ended (end of text or max new tokens), False while streaming
    z: torch.Tensor | None = None  # (T, d) final states of prompt + tokens[:-1], computed on first selection

    @property
    def token_ids(self) -> list[int]:
        return [s.token_id for s in self.steps]

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.steps)

    def input_ids(self, upto: int | None = None) -> torch.Tensor:
        """prompt + generated tokens [:upto], (1, T)."""
        return torch.tensor([self.prompt_ids + self.token_ids[:upto]])


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

    @property
    def total(self) -> float:
        return self.residual + sum(s.contribution for s in self.slices)

    def as_dict(self) -> dict:
        return {"token_id": self.token_id, "token": self.token, "logit": self.logit, "residual": self.residual,
                "sum": self.total, "slices": [s.__dict__ for s in self.slices], "removed_ids": self.removed_ids,
                "rerouted_ids": self.rerouted_ids}


@dataclass
class TokenView:
    index: int  # generated-token index
    position: int  # sequence position whose logits chose the token
    chosen: TokenDecomposition
    alternatives: list[TokenDecomposition]  # the top tokens at that position, chosen one included, by logit
    stream_logit: float  # the logit stream() chose the token from (KV-cached; equal up to float noise)
    carried: Carried | None = None  # None when the two logits tie (no choice to share out)

    def as_dict(self) -> dict:
        return {"index": self.index, "position": self.position, "stream_logit": self.stream_logit,
                "chosen": self.chosen.as_dict(), "alternatives": [a.as_dict() for a in self.alternatives],
                "carried": self.carried.as_dict() if self.carried else None}


@dataclass
class WhyChanged:
    """Why the intervened text has token `new` where `reference` would have been written."""

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


def _clean_query(text: str) -> str:
    """A search string as the database sees it: printable characters only, at most MAX_QUERY_CHARS."""
    text = "".join(ch for ch in str(text or "") if ch.isprintable()).strip()
    if not text:
        raise AppError("type something to search for")
    return text[:MAX_QUERY_CHARS]


# ----------------------------------------------------------------------------------------------------------------
# The studio: model, tokenizer and database, shared read-only by every user.


class Studio:
    def __init__(self, model: PrismForCausalLM, tokenizer, db: Database | None = None,
                 db_error: str | None = None, limits: Limits | None = None) -> None:
        self.model = model.eval()
        self.limits = limits or Limits()
        self.tokenizer = tokenizer
        self.db = db
        self.db_error = db_error
        self.n_prototypes = model.config.n_prototypes
        # Generation ends at the tokenizer's end-of-text and other special tokens (none is ever shown as text).
        self.stop_ids = frozenset(int(i) for i in tokenizer.all_special_ids)
        self._map_points: list[dict] | None = None
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

    # -- labels -----------------------------------------------------------------------------------------------

    def label(self, prototype_id: int) -> tuple[str, str]:
        """(label, category) of a prototype; ("", "unlabelled") without a database."""
        if self.db is None:
            return "", UNLABELLED
        return self.db.labels.get(int(prototype_id), ("", UNLABELLED))

    def check_prototype(self, prototype_id) -> int:
        if isinstance(prototype_id, str):
            prototype_id = prototype_id.strip()
            if not prototype_id.lstrip("-").isdigit():
                raise AppError(f"a prototype id is a whole number, got {prototype_id[:40]!r}")
        x = limits.number("a prototype id", prototype_id, -math.inf, math.inf)
        if x != int(x):
            raise AppError(f"a prototype id is a whole number, got {x:g}")
        if not 0 <= x < self.n_prototypes:
            raise AppError(f"no prototype {x:.0f}: this model has prototypes 0..{self.n_prototypes - 1}")
        return int(x)

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
        """Generate with model.stream(), yielding the growing Generation after every token."""
        interventions = interventions or Interventions()
        try:
            interventions.check(self.n_prototypes)
        except ValueError as err:
            raise AppError(str(err)) from None
        settings = self.check_settings(settings)
        ids, max_new, notes = self.encode_prompt(settings)
        gen = Generation(settings=settings, interventions=interventions, prompt_ids=ids,
                         prompt_text=self.tokenizer.decode(ids), notes=notes)
        input_ids = torch.tensor([ids])  # (1, T)
        for step in self.model.stream(input_ids, max_new, interventions=interventions,
                                      do_sample=settings.do_sample, temperature=settings.temperature or 1.0,
                                      top_p=settings.top_p, seed=settings.seed):
            token = int(step.token_ids[0])
            if token in self.stop_ids:  # end of text: stop there, and never show a special token as text
                gen.notes.append(f"the model ended the text after {len(gen.steps)} token(s)")
                gen.finished = True
                yield gen
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
            gen.steps.append(Step(token_id=token, text=self.tokenizer.decode([token]),
                                  prototype_ids=pids[order].tolist(), activations=acts[order].tolist(),
                                  logit=float(step.logits[0, token]), rerouted_ids=rerouted,
                                  state=step.state[0].clone() if kept else None))
            if len(gen.steps) == max_new:
                gen.finished = True
            yield gen

    def generate(self, settings: GenerationSettings, interventions: Interventions | None = None) -> Generation:
        gen = None
        for gen in self.stream(settings, interventions):  # noqa: B007 - the last value is the whole text
            continue
        return gen

    def top_category(self, step: Step) -> str:
        return self.label(step.prototype_ids[0])[1] if step.prototype_ids else NO_PROTOTYPE

    # -- decomposition ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def final_states(self, gen: Generation) -> torch.Tensor:
        """z (T, d) for prompt + tokens[:-1] (one forward pass). Kept on the generation while it is at most
        limits.keep_states_tokens long, so the next click is fast; a longer one is recomputed on every click, so a
        session never holds more than that many states per text."""
        n = len(gen.prompt_ids) + len(gen.steps) - 1
        if gen.z is not None and gen.z.shape[0] >= n:
            return gen.z
        z, _ = self.model.final_states(gen.input_ids(len(gen.steps) - 1))
        if n <= self.limits.keep_states_tokens:
            gen.z = z[0]
        return z[0]

    def state(self, gen: Generation, index: int) -> torch.Tensor:
        """z (d,) at the position that chose generated token `index`: the state the generation itself computed
        when it was kept, else from one forward pass over the text (final_states). The same value up to float
        rounding (a cached forward vs a full one), so the slices still add up to the logit shown."""
        index, position = self.token_position(gen, index)
        state = gen.steps[index].state
        return state if state is not None else self.final_states(gen)[position]

    def token_position(self, gen: Generation, index) -> tuple[int, int]:
        """(generated-token index, the sequence position whose logits chose it); AppError for a bad index."""
        index = limits.whole("the token index", index, -2**31, 2**31)
        if not 0 <= index < len(gen.steps):
            raise AppError(f"there is no generated token {index}: this text has {len(gen.steps)}")
        return index, len(gen.prompt_ids) + index - 1

    @torch.no_grad()
    def token_view(self, gen: Generation, index: int, n_alternatives: int = 5) -> TokenView:
        """Decomposition of generated token `index` and of the top alternatives at its position."""
        index, position = self.token_position(gen, index)
        z = self.state(gen, index)[None, None]  # (1, 1, d)
        out = self.model.head(z, gen.interventions)
        logits = out.logits[0, 0]  # (V,)
        chosen = gen.steps[index].token_id
        top = [int(t) for t in logits.topk(min(n_alternatives, logits.shape[0])).indices]
        tokens = [chosen] + [t for t in top if t != chosen]
        tokens = sorted(tokens, key=lambda t: -float(logits[t]))
        decs = self.model.decompose_output(out, 0, tokens)
        views = {d.token_id: self._decomposition(d) for d in decs}
        runner = next((d for d in decs if d.token_id != chosen), None)  # decs are in logit order
        carried = runner and Carried.of(next(d for d in decs if d.token_id == chosen), runner,
                                        views[runner.token_id].token)
        return TokenView(index=index, position=position, chosen=views[chosen],
                         alternatives=[views[t] for t in tokens], stream_logit=gen.steps[index].logit,
                         carried=carried)

    def _decomposition(self, d) -> TokenDecomposition:
        slices = []
        for pid, act, contribution in zip(d.prototype_ids, d.activations, d.contributions):
            label, category = self.label(pid)
            slices.append(Slice(pid, label, category, act, contribution))
        return TokenDecomposition(token_id=d.token_id, token=self.tokenizer.decode([d.token_id]), logit=d.logit,
                                  residual=d.residual, slices=slices, removed_ids=d.removed_ids,
                                  rerouted_ids=d.rerouted_ids)

    # -- what an intervention changed -------------------------------------------------------------------------

    @torch.no_grad()
    def why_changed(self, original: Generation, intervened: Generation, index: int) -> WhyChanged:
        """Which of the intervened prototypes made the intervened text write token `index`.

        The reference is what the model without interventions writes at the same place after the same text:
        the original token at the first change, else the plain model's top token on the intervened prefix. Each
        intervened prototype active there gets its effect on logit(new) - logit(reference) (the effects add up
        exactly to the change of that margin); the flip set is the shortest run of the strongest effects whose
        intervention alone makes the model (greedy) stop writing the reference token.
        """
        index, position = self.token_position(intervened, index)
        diff = side_by_side(original, intervened)
        new = intervened.steps[index].token_id
        z = self.state(intervened, index)[None, None]  # (1, 1, d)
        plain = self.model.head(z)
        if diff.first_change is None or index < diff.first_change:
            return WhyChanged(index, self.tokenizer.decode([new]), None,
                              "this token is the same in both texts", [], [])
        reference = original.steps[index].token_id if index == diff.first_change else \
            int(plain.logits[0, 0].argmax())
        if reference == new:
            return WhyChanged(index, self.tokenizer.decode([new]), None,
                              "the interventions did not change this token directly: without them the model would "
                              "write the same token here; it differs from the original because the text before "
                              "it differs", [], [])
        ids, acts = plain.prototype_ids[0, 0], plain.activations[0, 0]  # (k,) the model's own
        used = self.model.head(z, intervened.interventions)
        new_ids, new_acts = used.used_prototype_ids[0, 0], used.used_activations[0, 0]  # (k',) what it used
        # Every prototype whose activation differs, own or re-routed: z' - z = sum_p (a'_p - a_p) p_p exactly, so
        # these effects add up to the change of logit(new) - logit(ref).
        change: dict[int, float] = {}
        for pid, a in zip(ids.tolist(), acts.tolist()):
            change[pid] = change.get(pid, 0.0) - a
        for pid, a in zip(new_ids.tolist(), new_acts.tolist()):
            change[pid] = change.get(pid, 0.0) + a
        moved = torch.tensor([p for p, c in change.items() if c != 0], dtype=torch.long)
        rows = self.model.lm_head.weight[[new, reference]]  # (2, d)
        signature = rows @ self.model.prototypes.weight[moved].T  # (2, n)
        effects = {p: change[p] * float(signature[0, n] - signature[1, n]) for n, p in enumerate(moved.tolist())}
        _, replacing = changed_selection(ids, acts, new_ids, new_acts)
        ordered = sorted(effects, key=lambda p: -effects[p])
        flip_set: list[int] = []
        for pid in (p for p in ordered if p not in replacing):  # only what the user intervened on can be undone
            if effects[pid] <= 0:
                break
            flip_set.append(pid)
            logits = self.model.head(z, restrict(intervened.interventions, set(flip_set))).logits[0, 0]
            if int(logits.argmax()) != reference:
                break
        else:
            flip_set = []
        if flip_set and int(self.model.head(z, restrict(intervened.interventions, set(flip_set)))
                            .logits[0, 0].argmax()) == reference:
            flip_set = []
        ref_text = self.tokenizer.decode([reference])
        if not effects:
            message = "no intervened prototype is active here"
        elif flip_set:
            message = (f"without the interventions the model writes {ref_text!r} here; intervening on "
                       f"{', '.join(f'#{p}' for p in flip_set)} alone is enough to change that")
        else:
            message = (f"without the interventions the model writes {ref_text!r} here; no subset of the "
                       "intervened prototypes flips the greedy choice on its own (the token was sampled)")
        if replacing:
            message += ("; the suppressed prototypes' slots were re-routed to "
                        + ", ".join(f"#{p} {self.label(p)[0]!r}".replace(" ''", "") for p in replacing))
        describe = lambda p: {"prototype_id": p, "label": self.label(p)[0], "category": self.label(p)[1],  # noqa: E731
                              "effect": effects[p], "role": "replacement" if p in replacing else "intervened"}
        return WhyChanged(
            index=index, new_token=self.tokenizer.decode([new]), reference_token=ref_text, message=message,
            effects=[describe(p) for p in ordered], flip_set=flip_set,
            replacements=[describe(p) | {"activation": float(new_acts[new_ids == p].sum())} for p in replacing])

    # -- the database -----------------------------------------------------------------------------------------

    def need_db(self) -> Database:
        """The database, or AppError saying how to build one."""
        if self.db is None:
            raise AppError(BUILD_HINT if self.db_error is None else f"{self.db_error}. {BUILD_HINT}")
        return self.db

    def card(self, prototype_id, n_evidence: int = 6) -> dict:
        """A prototype card (label, scores, stats, histogram, signature, co-active, siblings) and its evidence."""
        pid = self.check_prototype(prototype_id)
        db = self.need_db()
        try:
            card = db.run(query.prototype_card, pid)
            card["evidence"] = db.run(query.evidence, pid, limit=n_evidence)
            card["siblings"] = db.run(query.siblings, pid)
        except UnknownPrototype as err:
            raise AppError(str(err)) from None
        return card

    def search(self, text: str, mode: str = "label", k: int = 50) -> list[dict]:
        """Label (substring) or semantic search (labels, predictions and whatever evidence embeddings the database
        holds; the best match of each prototype, nearest first, none left out); rows {prototype_id, label, category,
        score} and, for semantic search, matched (the kind of the best match)."""
        db = self.need_db()
        needle = _clean_query(text)
        from precompute.search import label_search, semantic_search

        if mode == "label":
            rows = db.run(label_search, needle, k=k)
            return [{"prototype_id": r["prototype_id"], "label": r["label"], "category": r["category"],
                     "score": r["label_score"]} for r in rows]
        if mode == "semantic":
            if not db.has_embeddings:
                raise AppError("this database has no search embeddings: run `python -m precompute.search --db DB`")
            rows = db.run(semantic_search, needle, k=k, kind="all")
            return [{"prototype_id": r["prototype_id"], "label": r["label"], "category": r["category"],
                     "score": r["score"], "matched": r["kind"]} for r in rows]
        raise AppError(f"search mode must be 'label' or 'semantic', got {mode!r}")

    def filters(self) -> list[str]:
        """What the browser's category filter offers: the database's categories, then 'unlabelled' (no label) and
        'never active' (no activation in the corpus) whether or not any prototype is in them."""
        categories = self.db.categories if self.db is not None else []
        return [*categories, *(f for f in (UNLABELLED, NEVER_ACTIVE) if f not in categories)]

    def table(self, category: str | None = None, order_by: str = "activation_count") -> list[dict]:
        """Every prototype of the database (or of one category / filter), sorted."""
        db = self.need_db()
        if category and category not in self.filters():
            raise AppError(f"unknown category {category!r}: one of {', '.join(self.filters())}")
        if order_by not in query.ORDERINGS:
            raise AppError(f"sort by one of {', '.join(query.ORDERINGS)}, got {order_by!r}")
        if category in (UNLABELLED, NEVER_ACTIVE):
            rows = db.run(query.prototype_table, order_by=order_by)
            if category == UNLABELLED:
                return [r for r in rows if not r["label"] or r["category"] in (None, UNLABELLED)]
            return [r for r in rows if not r["activation_count"]]
        return db.run(query.prototype_table, category=category or None, order_by=order_by)

    def category_ids(self, category: str) -> list[int]:
        db = self.need_db()
        ids = [p for p, (_, c) in db.labels.items() if c == category]
        if not ids:
            raise AppError(f"no prototype has category {category!r}")
        return sorted(ids)

    def presets(self) -> list[dict]:
        """The database's intervention presets that hold prototypes: [{name, title, description, n}]."""
        if self.db is None:
            return []
        from precompute.presets import PRESETS

        try:
            counts = dict(self.db.run(lambda c: c.execute(
                "SELECT name, count(*) FROM presets GROUP BY name").fetchall()))
        except duckdb.Error:  # a database built before presets existed
            return []
        return [{"name": name, "title": spec.title, "description": spec.description, "n": counts[name]}
                for name, spec in PRESETS.items() if counts.get(name)]

    def preset_ids(self, name: str) -> tuple[str, list[int]]:
        """(title, prototype ids) of a preset, by name or title."""
        for preset in self.presets():
            if str(name) in (preset["name"], preset["title"]):
                rows = self.db.run(lambda c, key: c.execute(
                    "SELECT prototype_id FROM presets WHERE name = ? ORDER BY 1", [key]).fetchall(), preset["name"])
                return preset["title"], [r[0] for r in rows]
        known = ", ".join(p["name"] for p in self.presets()) or "none in this database"
        raise AppError(f"no preset {str(name)[:60]!r}; presets: {known}")

    def map_points(self) -> list[dict]:
        """The map's points, read once: the database is read-only and the map follows every search and card."""
        if self._map_points is None:
            self._map_points = self.need_db().run(query.map_points)
        return self._map_points


# ----------------------------------------------------------------------------------------------------------------
# Pure helpers.


def restrict(interventions: Interventions, ids: set[int]) -> Interventions:
    """The part of `interventions` that concerns the prototypes in ids (a controller's part included)."""
    controller = interventions.controller
    return Interventions(suppress=frozenset(interventions.suppress & ids),
                         scale={p: f for p, f in interventions.scale.items() if p in ids},
                         inject={p: a for p, a in interventions.inject.items() if p in ids},
                         controller=None if controller is None else controller.restricted(ids),
                         suppress_mode=interventions.suppress_mode)


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


def same_settings(gen: Generation | None, settings: GenerationSettings) -> bool:
    return gen is not None and gen.settings == settings
