"""Labeler v3 ('offline-v3', the default 'offline'): labels with two sides and two levels (issue 37).

A prototype's slice `a_i W p_i` acts on the *next* token, so a label that only names the token it fires on is on the
wrong side: suppressing "'unto' after 'said'" does not remove "unto". A v3 label says both, built from the visible
(even-ranked) evidence only, like v2:

    fires_on   where it fires: v2's planning (the tokens and their kind, the word before or after, the place in
               the line, the source, the context words that set it apart from its siblings) without v2's
               "predicting ..." modifier, which moved to the other side
    pushes     what it pushes the next token toward: the next tokens of its visible evidence that its logit
               signature W p_i also raises, when they follow enough of it; else the kind most next tokens share
               ("names (Hebron, Bethlehem)", "words (eat, take)"); else the signature's top tokens (pushes_part)
    label      "fires_on → pushes", e.g. "'unto' after 'said' → names (Moses, Aaron)"

and two levels, as in the paper's demo: the broad category of the paper's taxonomy and a specific topic, "religion -
scripture". The topic is the entry of a written vocabulary (TOPICS: a name, its category and a description) closest
to the centre (mean) of the prototype's visible context embeddings, scored as a z-score against the centres of
random sets of as many contexts (so a description close to everything does not win everywhere); below TOPIC_MIN, or
when fewer than TOPIC_SUPPORT of the contexts are on it one by one, there is no topic. The category keeps the token
rules where they decide (word pieces, numbers, URLs, currency, boilerplate, and a function word whose next tokens
are one field: v1's slot rule); a function-word prototype whose contexts have a clear topic (z >= TOPIC_STRONG)
takes the topic's category, and so does a content-word prototype with any topic.

Which fires_on candidate is chosen: v2's objective on the visible evidence, for the whole label, with the marked
scorer of detection.py in place of the bare embedding (the scorer the held-out detection scores use); labels are
kept distinct the same way. Everything is deterministic (sorted SQL, seeded samples, fixed orders).
"""

from __future__ import annotations

import logging
import re
from collections import Counter

import numpy as np

from precompute.embed import EMBED_MODEL, embed
from precompute.labels import contrast, detection
from precompute.labels.cards import PrototypeCard
from precompute.labels.labeler import LabelResult
from precompute.labels.offline import SCAFFOLDING
from precompute.labels.scoring import auroc
from precompute.labels.tokens import quote, token_kind

logger = logging.getLogger("precompute.labels.twosided")

ARROW = " → "
MAX_FIRES_CHARS = 64  # the fires_on part of a label
MAX_PUSHES_CHARS = 40  # the pushes part
N_PUSHED = 3  # tokens named on the pushes side
MIN_PUSH_SHARE = 0.15  # a next token the signature raises must follow this share of the visible evidence
MIN_NAMED_COVERAGE = 0.4  # ... and the named ones together this share, else the kind of the next tokens is named
MIN_GROUP_SHARE = 0.5  # a kind of next token (PUSH_GROUPS) named when it follows this share of the evidence
# token kind -> the group a pushes side names (a phrase of tokens.KIND_PHRASES where one exists, so that
# detection.parse_claims reads it back as a kind)
PUSH_GROUPS = {"proper noun": "names", "content": "words", "number": "numbers", "year": "numbers",
               "number word": "numbers", "percentage": "numbers", "money": "numbers", "punctuation": "punctuation",
               "whitespace": "line breaks and spacing", "suffix": "word endings", "inner": "word endings",
               "prefix": "word endings", **{k: "function words" for k in (
                   "determiner", "preposition", "conjunction", "pronoun", "auxiliary verb", "particle",
                   "archaic pronoun", "archaic form")}}
TOPIC_MIN = 2.5  # z-score (against random sets of contexts) from which a topic is named
TOPIC_STRONG = 3.5  # ... and from which it also decides the category of a function-word prototype
N_CONTEXTS = 16  # contexts per random set in the topic calibration (a prototype shows 16 visible ones)
TOPIC_SUPPORT = 0.5  # ... and only when this share of the visible contexts is on the topic one by one:
TOPIC_SUPPORT_Z = 1.0  # its own similarity to the topic at least this z-score against single random contexts
_SPECIAL = re.compile(r"<\|[^|]*\|>|<s>|</s>")  # a tokenizer's special tokens: never named as pushed
RULE_KEPT = ("morphology", "numbers/time", "urls", "finance", "boilerplate")  # categories the token rules decide

# The topic vocabulary: (topic, category of the paper's taxonomy, description that gets embedded). Written for this
# project; modern subjects as well as the old corpora's.
TOPICS: tuple[tuple[str, str, str], ...] = (
    ("religion - scripture", "social", "Bible verses: the LORD God spoke unto Moses, and the children of Israel"),
    ("religion - worship and sacrifice", "social", "offerings, sacrifice, altar, priests, the tabernacle, burnt "
                                                   "offering, holy, worship"),
    ("religion - prayer and praise", "social", "prayer, praise, psalms, mercy, blessed, glory, salvation, soul"),
    ("religion - church and faith", "social", "church, faith, Jesus Christ, the disciples, gospel, apostles"),
    ("family and kinship", "social", "father, mother, son, daughter, brother, wife, children, family, begat"),
    ("everyday life", "social", "shopping, dinner, weekend plans, friends, coffee, home, the kids, errands"),
    ("emotions and relationships", "social", "love, fear, anger, joy, sorrow, friendship, trust, feelings"),
    ("education", "social", "school, students, teachers, university, classes, learning, exams"),
    ("sport", "social", "football, match, team, players, season, goals, championship, coach"),
    ("arts and music", "social", "music, songs, painting, film, theatre, album, artist, novel"),
    ("food and cooking", "social", "food, bread, meat, wine, cooking, meals, recipes, eating"),
    ("mythology and legend", "social", "Greek mythology: gods, heroes, Achilles, Odysseus, Troy, Zeus"),
    ("fiction - narrative", "social", "a novel's narration: he looked at her, she said quietly, they walked on"),
    ("government and politics", "institutional", "government, Congress, the President, elections, parties, "
                                                  "policy, legislation"),
    ("speeches and addresses", "institutional", "an address to the nation: my fellow citizens, the Union, our "
                                                "country, Americans"),
    ("law and courts", "institutional", "law, courts, judges, trials, rights, the constitution, legal cases"),
    ("war and military", "institutional", "war, army, soldiers, battle, troops, weapons, defence, enemy"),
    ("kings and kingdoms", "institutional", "kings, kingdom, reign, throne, princes, rulers, empire, conquest"),
    ("international affairs", "institutional", "nations, treaties, foreign policy, allies, diplomacy"),
    ("organisations", "institutional", "organisations, committees, agencies, departments, associations, boards"),
    ("economy and trade", "finance", "the economy, trade, markets, industry, growth, jobs, inflation"),
    ("money and taxes", "finance", "money, taxes, budget, prices, dollars, spending, debt, wages"),
    ("business and companies", "finance", "companies, business, shares, profit, sales, customers, firms"),
    ("agriculture and land", "environment", "farming, fields, crops, harvest, cattle, sheep, land, soil"),
    ("nature and animals", "environment", "animals, birds, trees, forests, rivers, mountains, wildlife"),
    ("sea and ships", "environment", "the sea, ships, sailors, whales, the ocean, voyage, harbour, waves"),
    ("weather and climate", "environment", "weather, rain, storms, wind, climate, temperature, snow"),
    ("countries and places", "named entities", "countries, cities, regions, borders, population, located in"),
    ("people's names", "named entities", "people named by name: John, Mary, Abraham, Lincoln, Smith"),
    ("history", "institutional", "history: centuries, the ancient world, empires, revolutions, historical events"),
    ("medicine and health", "medical/bio", "medicine, health, disease, patients, doctors, treatment, hospital"),
    ("medical/bio - physiology", "medical/bio", "the body: blood, heart, flesh, bones, brain, organs, birth"),
    ("biology and life", "medical/bio", "biology: cells, genes, species, evolution, organisms, plants"),
    ("science and research", "science/tech", "science, research, experiments, theory, physics, chemistry"),
    ("mathematics", "science/tech", "mathematics: numbers, equations, functions, sets, theorems, proofs"),
    ("computing and software", "science/tech", "computers, software, programs, data, files, the internet, "
                                               "servers"),
    ("programming code", "science/tech", "source code: def function(self, x): return value; import module; "
                                         "class"),
    ("email and correspondence", "social", "an email message: thanks, let me know, regards, please reply, "
                                           "the list"),
    ("technology and devices", "science/tech", "devices, phones, machines, engines, electricity, technology"),
    ("language and writing", "social", "language, words, writing, grammar, books, letters, names, meaning"),
    ("philosophy and ideas", "social", "philosophy, thought, reason, ideas, truth, knowledge, morality"),
    ("journalism and news", "institutional", "news reports: officials said on Tuesday, according to a statement"),
    ("numbers and measures", "numbers/time", "numbers and measures: one hundred, twenty, cubits, miles, years "
                                             "old, percent"),
    ("dates and time", "numbers/time", "dates and times: in 1850, on Monday, years later, the third day"),
    ("references and citations", "boilerplate", "references: cited, retrieved, ISBN, edition, pages, journal, "
                                                "published"),
    ("web and links", "urls", "web addresses, links, http, www, email addresses, websites"),
)


def topic_vectors() -> np.ndarray:
    """(T, D) embeddings of the topic descriptions."""
    return embed([f"{name}: {text}" for name, _, text in TOPICS], progress=False)


def pushes_part(card: PrototypeCard) -> tuple[str | None, list[str]]:
    """(the pushes side of a label or None, the tokens it names), from a card with its visible evidence only.

    1. The tokens that follow the visible evidence and that the logit signature raises (positive, among its top
       tokens), most frequent first, when together they follow at least MIN_NAMED_COVERAGE of the evidence;
    2. else the kind most of the following tokens share (at least MIN_GROUP_SHARE: "names (Hebron, Bethlehem)",
       "words (white, wild)", "punctuation (, :)"), with its commonest examples, raised ones first;
    3. else the signature's own top raised tokens (what W p_i pushes up wherever the prototype is active).
    Several tokens of one kind are named by it ("names (Moses, Aaron)")."""
    raised = {}
    for token, value in card.logit_tokens:
        if value > 0 and token.strip() and not _SPECIAL.fullmatch(token.strip()):
            raised.setdefault(token.strip().lower(), token)
    following: Counter = Counter()
    kinds = {}
    for e in card.evidence:
        j = e.token_index + 1
        if j < len(e.context_tokens):
            piece = e.context_tokens[j]
            if _SPECIAL.fullmatch(piece.strip()):
                continue
            key = piece.strip().lower() or "\n"
            following[key] += 1
            kinds.setdefault(key, token_kind(piece, e.context_tokens, j))
    n = max(1, sum(following.values()))
    ranked = [k for k, _ in sorted(following.items(), key=lambda kv: (-kv[1], kv[0]))]
    named = [k for k in ranked if k in raised and following[k] / n >= MIN_PUSH_SHARE][:N_PUSHED]
    groups: Counter = Counter(PUSH_GROUPS.get(kinds[k].kind, "words") for k in following.elements())
    group, share = min(groups.items(), key=lambda kv: (-kv[1], kv[0])) if groups else ("", 0)
    if named and sum(following[k] for k in named) / n >= MIN_NAMED_COVERAGE:
        chosen = [(k, kinds[k]) for k in named]
    elif share / n >= MIN_GROUP_SHARE:
        members = [k for k in ranked if PUSH_GROUPS.get(kinds[k].kind, "words") == group]
        members = sorted(members, key=lambda k: (k not in raised, -following[k], k))[:N_PUSHED]
        return _push_text(group, [_shown(kinds[k]) for k in members])
    else:
        chosen = [(k, token_kind(raised[k])) for k in list(raised)[:N_PUSHED]]
    if not chosen:
        return None, []
    shown = list(dict.fromkeys(_shown(k) for _, k in chosen))
    kind, count = Counter(k.kind for _, k in chosen).most_common(1)[0]
    group = PUSH_GROUPS.get(kind, "")
    if len(shown) > 1 and count == len(chosen) and group not in ("", "words", "punctuation", "function words"):
        return _push_text(group, shown)
    return _push_text("", shown)


def _shown(kind) -> str:
    return kind.word if kind.kind == "proper noun" and kind.word else (kind.core or "line break")


def _push_text(group: str, shown: list[str]) -> tuple[str, list[str]]:
    """'names (Moses, Aaron)' or "'the', 'a'", cut to MAX_PUSHES_CHARS by dropping the last tokens."""
    shown = list(dict.fromkeys(shown))
    if shown == ["line break"]:  # one line break, not "line breaks and spacing (line break)"
        return "a line break", shown
    while True:
        listed = ", ".join(s if group else ("a line break" if s == "line break" else quote(s)) for s in shown)
        text = f"{group} ({listed})" if group else listed
        if len(text) <= MAX_PUSHES_CHARS or len(shown) == 1:
            return text[:MAX_PUSHES_CHARS], shown
        shown = shown[:-1]


class TwoSidedLabeler(contrast.ContrastiveLabeler):
    """Labeler v3 (module docstring). LabelResult carries fires_on, pushes and topic besides the label."""

    name = "offline-v3"
    model_id = EMBED_MODEL

    def __init__(self) -> None:
        super().__init__()
        self._topics: np.ndarray | None = None  # (T, D)
        self._topic_mean = np.zeros(len(TOPICS))  # (T,) see _calibrate_topics
        self._topic_sd = np.ones(len(TOPICS))  # (T,)
        self._single_mean = np.zeros(len(TOPICS))  # (T,) the same for single contexts
        self._single_sd = np.ones(len(TOPICS))  # (T,)

    def prepare(self, background: np.ndarray) -> None:
        super().prepare(background)
        self._topics = topic_vectors()

    def prepare_contrast(self, ctx: contrast.ContrastContext) -> None:
        self._calibrate_topics(ctx)
        super().prepare_contrast(ctx)

    def _calibrate_topics(self, ctx: contrast.ContrastContext, n_sets: int = 256, seed: int = 0) -> None:
        """Each topic's mean and spread of similarity to the centres of random sets of N_CONTEXTS visible contexts
        (seeded draws from the selection sample): a prototype's topic is scored as a z-score against them."""
        if self._topics is None:
            self._topics = topic_vectors()
        sample = ctx.vectors[ctx.select_rows]
        if len(sample) < 2:
            return
        rng = np.random.default_rng(seed)
        size = min(N_CONTEXTS, len(sample))
        centres = np.stack([_unit(sample[rng.choice(len(sample), size=size, replace=False)].mean(axis=0))
                            for _ in range(n_sets)])  # (n_sets, D)
        sims = centres @ self._topics.T  # (n_sets, T)
        self._topic_mean, self._topic_sd = sims.mean(axis=0), np.maximum(sims.std(axis=0), 1e-6)
        single = sample @ self._topics.T  # (S, T) one context at a time, for TOPIC_SUPPORT
        self._single_mean, self._single_sd = single.mean(axis=0), np.maximum(single.std(axis=0), 1e-6)

    def topic(self, ctx: contrast.ContrastContext, pid: int) -> tuple[str | None, str | None, float]:
        """(topic, its category, z-score) of a prototype's visible contexts: the similarity of their centre to each
        topic description as a z-score against random sets of contexts; (None, None, z) below TOPIC_MIN."""
        rows = ctx.rows(pid, held_out=False)
        if not rows:
            return None, None, 0.0
        if self._topics is None:
            self._topics = topic_vectors()
        z = (self._topics @ _unit(ctx.vectors[rows].mean(axis=0)) - self._topic_mean) / self._topic_sd  # (T,)
        best = int(np.argmax(z))
        if z[best] < TOPIC_MIN or topic_support(ctx.vectors[rows], self._topics[best], self._single_mean[best],
                                                self._single_sd[best]) < TOPIC_SUPPORT:
            return None, None, float(z[best])
        return TOPICS[best][0], TOPICS[best][1], float(z[best])

    def _options(self, ctx: contrast.ContrastContext, card: PrototypeCard) -> list[tuple[float, str, str]]:
        """[(objective, label, explanation)] best first: every fires_on candidate with the pushes side, scored by
        the marked scorer (detection.py) on the visible evidence: RANDOM_WEIGHT x AUROC against the selection sample
        + the rest x AUROC against the siblings' visible contexts."""
        pid = card.prototype_id
        visible = contrast.replace_evidence(card, card.evidence[0::2])
        pushes, _ = pushes_part(visible)
        texts = [f"{f}{ARROW}{pushes}" if pushes else f for f in fires_candidates(ctx, card)]
        vectors = embed(texts, progress=False)
        own = ctx.rows(pid, held_out=False)
        rand = ctx.select_rows[ctx.select_ids != pid]
        sib = [r for s in ctx.sibling_ids(pid) for r in ctx.rows(s, held_out=False)]
        out = []
        for i, (text, v) in enumerate(zip(texts, vectors, strict=True)):
            claims = detection.parse_claims(text)
            pos = detection.marked_scores(ctx, claims, v, own)
            a_rand = auroc(pos, detection.marked_scores(ctx, claims, v, rand)) if len(rand) else 0.5
            a_sib = auroc(pos, detection.marked_scores(ctx, claims, v, sib)) if sib else a_rand
            objective = contrast.RANDOM_WEIGHT * a_rand + (1 - contrast.RANDOM_WEIGHT) * a_sib - 1e-6 * i
            explanation = (f"visible-evidence AUROC (marked scorer) {a_rand:.2f} vs other prototypes, {a_sib:.2f} "
                           "vs siblings")
            out.append((objective, text, explanation))
        return sorted(out, key=lambda o: -o[0])

    def label(self, card: PrototypeCard) -> LabelResult:
        base = self._v1.label(card)
        if not card.evidence:
            return base
        ctx = self._ctx
        pid = card.prototype_id
        if pid in self._plan:
            label, explanation = self._plan[pid]
        elif ctx is not None and pid in ctx.cards:
            _, label, explanation = self._options(ctx, ctx.cards[pid])[0]
        else:  # a lone card without the job's context
            pushes, _ = pushes_part(card)
            fires = base.label.replace("mixed tokens", "tokens")[:MAX_FIRES_CHARS]
            label, explanation = (f"{fires}{ARROW}{pushes}" if pushes else fires), base.explanation
        fires_on, _, pushes = label.partition(ARROW)
        topic, topic_category, similarity = self.topic(ctx, pid) if ctx is not None and pid in ctx.cards else \
            (None, None, 0.0)
        category = base.category
        if category not in RULE_KEPT and topic_category is not None:
            if category != SCAFFOLDING or similarity >= TOPIC_STRONG:
                category = topic_category
        note = f"topic {topic} (z {similarity:.1f})" if topic else f"no topic (best z {similarity:.1f})"
        return LabelResult(category, label, f"{explanation}; {note}; v1 category {base.category}: "
                                            f"{base.explanation}"[:600],
                           fires_on=fires_on, pushes=pushes or None, topic=topic)


def fires_candidates(ctx: contrast.ContrastContext, card: PrototypeCard) -> list[str]:
    """v2's candidates for the fires_on side (contrast.candidates without the 'promotes' modifier), at most
    MAX_FIRES_CHARS, from the visible evidence."""
    pid = card.prototype_id
    visible = contrast.replace_evidence(card, card.evidence[0::2])
    background = contrast._background(ctx, pid)
    ref = ctx.sibling_profile(pid) if ctx.sibling_ids(pid) else background
    mods = contrast.modifiers(ctx.profiles[pid], ref, visible, background if ctx.sibling_ids(pid) else None)
    mods.pop("promotes", None)
    out = [t for t in contrast.candidates(contrast.heads(visible), mods) if len(t) <= MAX_FIRES_CHARS]
    return out or [contrast.heads(visible)[0][:MAX_FIRES_CHARS]]


def topic_support(vectors: np.ndarray, topic: np.ndarray, mean: float, sd: float) -> float:
    """The share of contexts (rows of vectors) that are on the topic one by one: their similarity to its description
    at least TOPIC_SUPPORT_Z standard deviations above a single random context's. A centre can lean toward a topic
    because a few contexts are about it; a topic is named only when most are."""
    if not len(vectors):
        return 0.0
    return float(np.mean((vectors @ topic - mean) / sd >= TOPIC_SUPPORT_Z))


def _unit(v: np.ndarray) -> np.ndarray:
    return v / (np.linalg.norm(v) or 1.0)
