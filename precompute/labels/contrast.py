"""Labeler v2 and sibling scores: labels that say what sets a prototype apart from its siblings.

Issue 14. In a 1,024-prototype bank dozens of prototypes fire on the same token (' the', ',', ' and'); a label that
names the token says nothing about why there are 68 of them. Here a prototype's **siblings** are the prototypes whose
evidence shares its tokens: with s_P(t) the share of P's evidence rows on token id t,

    overlap(P, Q) = sum_t min(s_P(t), s_Q(t))          (1 = the same token mix, 0 = no token in common)

and Q is a sibling of P when overlap >= MIN_OVERLAP (at most N_SIBLINGS, strongest first). The label is built from
what the database holds about the evidence the label may see (the even ranks; the odd ranks are held out):

    head        the tokens and their kind, by the token rules of tokens.py ("determiner 'the'",
                "suffix -eth", "'thou'/'thee'"); several unrelated tokens are listed, never "mixed tokens"
    modifiers   the word before / after the evidence token, its place in the sentence or line (sentence start,
                line start, before punctuation), the source and topic of the evidence documents (Bible verse
                (Genesis), Wikipedia (Anarchism), news), the words around it that are frequent in its evidence and
                rare in its siblings' ("near LORD, Moses") or rare in general, its commonest context words
                ("with LORD, children"), the token its logit signature W p_i promotes most

Candidates (a head plus one to three modifiers, at most MAX_LABEL_CHARS) are scored on the visible evidence only:
RANDOM_WEIGHT x AUROC of cos(label, context) separating the prototype's even-ranked contexts from a seeded sample of
other prototypes' even-ranked contexts (never the rows the held-out label_score is computed against) + the rest x
the same against its siblings' even-ranked contexts. (0.8: chosen on the shipped database, where it raised the mean
held-out label_score by about 0.01 over 0.5 for 0.004 less sibling_score; 4-6 words and more candidates added 0.02.)
The best candidate not already taken by another prototype wins (so labels are distinct), ties to
the earlier candidate. Everything is deterministic: sorted SQL, seeded samples, one embedding call per list.

Scores (both held out, both written by the labels job for every labeler):
    label_score    AUROC against a seeded sample of other prototypes' contexts (scoring.py)
    sibling_score  AUROC of cos(label, context) separating the prototype's odd-ranked contexts from its siblings'
                   odd-ranked contexts only: does the label single it out among prototypes on the same tokens?
                   NULL for a prototype without siblings.

The job also writes `label_siblings`: per prototype its siblings with their overlap and a short "what separates
them" string (query.siblings reads it for the card).

    python -m precompute.labels --db out.duckdb                     # v2 is the default labeler ('offline')
    python -m precompute.labels --db out.duckdb --labeler offline-v1  # the earlier token-rule labels
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import duckdb
import numpy as np

from precompute.embed import EMBED_MODEL, embed
from precompute.labels.cards import EvidenceContext, PrototypeCard, load_cards
from precompute.labels.labeler import MAX_LABEL_CHARS, LabelResult
from precompute.labels.offline import OfflineLabeler
from precompute.labels.scoring import NegativePool, auroc
from precompute.labels.tokens import FUNCTION_WORDS, KIND_PHRASES, quote, token_kind

logger = logging.getLogger("precompute.labels.contrast")

N_SIBLINGS = 12  # siblings kept per prototype, strongest overlap first
MIN_OVERLAP = 0.2  # token-mix overlap from which another prototype counts as a sibling
N_SELECT = 512  # other prototypes' visible contexts that candidate labels are chosen against
MIN_SHARE = 0.3  # a word before/after, a position or a source must cover this share of the visible evidence
MIN_LEAD = 0.15  # ... and this much more than among the siblings (or all evidence) to be named
N_WORDS = 6  # distinctive context words named at most (fewer when the label would pass MAX_LABEL_CHARS)
MIN_CONTEXTS = 2  # a context word is named only when it occurs in this many visible contexts
BARE_COVER = 0.5  # a bare head lists the commonest evidence tokens until they cover this share of it ...
BARE_MAX = 3  # ... naming at most this many
RANDOM_WEIGHT = 0.8  # candidate objective: this * AUROC vs other prototypes + the rest * AUROC vs siblings
# Phrases that say nothing about a prototype; the goals of issue 14 count labels containing them as catch-alls.
CATCH_ALL = re.compile(r"\b(mixed|misc|miscellaneous|various|assorted|unclear)\b", re.IGNORECASE)
SOURCE_PHRASES = {"kjv": "Bible verse", "wiki": "Wikipedia", "news": "news reports", "fineweb": "web pages"}
_STOP = {w for words in FUNCTION_WORDS.values() for w in words} | {"s", "t", "said", "unto", "shall", "thee", "thou",
                                                                     "thy", "ye", "hath", "also"}
_WORD = re.compile(r"[A-Za-z][A-Za-z'’-]*[A-Za-z]")
_CLAUSE_END = tuple(",.;:!?)]”\"")
_SENTENCE_END = tuple(".!?:;")


# ----------------------------------------------------------------------------------------------------------------
# Siblings.


def sibling_pairs(con: duckdb.DuckDBPyConnection, prototype_id: int | None = None, n_siblings: int = N_SIBLINGS,
                  min_overlap: float = MIN_OVERLAP) -> dict[int, list[tuple[int, float]]]:
    """{prototype_id: [(sibling_id, overlap), ...]} strongest first (ties: lower id), from the evidence token ids.
    With prototype_id, only that prototype's row is computed."""
    where, params = ("WHERE a.prototype_id = ?", [int(prototype_id)]) if prototype_id is not None else ("", [])
    rows = con.execute(f"""
        WITH n AS (SELECT prototype_id, count(*) AS n FROM evidence GROUP BY prototype_id),
        s AS (SELECT e.prototype_id, e.token_id, count(*) / any_value(n.n) AS share
              FROM evidence e JOIN n USING (prototype_id) GROUP BY e.prototype_id, e.token_id),
        o AS (SELECT a.prototype_id, b.prototype_id AS sibling_id, sum(least(a.share, b.share)) AS overlap
              FROM s a JOIN s b ON a.token_id = b.token_id AND a.prototype_id <> b.prototype_id
              {where} GROUP BY a.prototype_id, b.prototype_id),
        r AS (SELECT *, row_number() OVER (PARTITION BY prototype_id ORDER BY overlap DESC, sibling_id) AS r
              FROM o WHERE overlap >= ?)
        SELECT prototype_id, sibling_id, overlap FROM r WHERE r <= ? ORDER BY prototype_id, r""",
                       [*params, float(min_overlap) - 1e-9, int(n_siblings)]).fetchall()
    out: dict[int, list[tuple[int, float]]] = {}
    for pid, sid, overlap in rows:
        out.setdefault(int(pid), []).append((int(sid), round(float(overlap), 6)))
    return out


# ----------------------------------------------------------------------------------------------------------------
# Profiles: countable facts about a set of evidence contexts.


@dataclass
class Profile:
    """What a set of evidence contexts has in common, as counts (each context counts once per fact)."""

    n: int = 0
    prev: Counter = field(default_factory=Counter)  # the piece before the evidence token, stripped, lower case
    next: Counter = field(default_factory=Counter)  # the piece after it
    position: Counter = field(default_factory=Counter)  # sentence start | line start | before punctuation
    source: Counter = field(default_factory=Counter)  # documents.source
    topic: Counter = field(default_factory=Counter)  # (source, topic): a Bible book, a Wikipedia article
    words: Counter = field(default_factory=Counter)  # lower-case context words (each once per context)
    cased: Counter = field(default_factory=Counter)  # their spellings, to show the commonest

    def add(self, other: Profile) -> None:
        self.n += other.n
        for name in ("prev", "next", "position", "source", "topic", "words", "cased"):
            getattr(self, name).update(getattr(other, name))

    def share(self, name: str, key) -> float:
        return getattr(self, name)[key] / self.n if self.n else 0.0


def _piece(text: str) -> str:
    return text.strip().lower() or "line break"


def _topic(source: str, title: str | None) -> str | None:
    if not title:
        return None
    if source == "kjv":  # "Genesis 1" -> "Genesis"
        return re.sub(r"\s+\d+$", "", title).strip() or None
    return title.strip() or None


def profile(contexts: Sequence[EvidenceContext], documents: dict[str, tuple[str, str | None]]) -> Profile:
    """Counts over contexts; documents maps doc_id -> (source, title)."""
    p = Profile(n=len(contexts))
    for e in contexts:
        i, pieces = e.token_index, e.context_tokens
        before = pieces[i - 1] if i > 0 else ""
        after = pieces[i + 1] if i + 1 < len(pieces) else ""
        if i > 0:
            p.prev[_piece(before)] += 1
        if after:
            p.next[_piece(after)] += 1
        gap = before + pieces[i][:len(pieces[i]) - len(pieces[i].lstrip())]
        if i > 0 and "\n" in gap or pieces[i].startswith("\n"):
            p.position["line start"] += 1
        elif i > 0 and before.strip().endswith(_SENTENCE_END):
            p.position["sentence start"] += 1
        if after.strip()[:1] and after.strip()[:1] in _CLAUSE_END:
            p.position["before punctuation"] += 1
        source, title = documents.get(e.doc_id, ("", None))
        if source:
            p.source[source] += 1
            topic = _topic(source, title)
            if topic:
                p.topic[(source, topic)] += 1
        own = pieces[i].strip().lower()
        seen = set()
        for w in _WORD.findall(e.window()):
            lw = w.lower()
            if lw in _STOP or lw == own or len(lw) < 3 or lw in seen:
                continue
            seen.add(lw)
            p.words[lw] += 1
            p.cased[w] += 1
    return p


def _spelling(p: Profile, word: str) -> str:
    forms = [(n, w) for w, n in p.cased.items() if w.lower() == word]
    return max(forms, key=lambda f: (f[0], f[1]))[1] if forms else word


def _lead(p: Profile, ref: Profile, name: str) -> list[tuple[object, float]]:
    """Values of a fact that cover MIN_SHARE of p and lead ref's share by MIN_LEAD, biggest lead first."""
    out = []
    for key, _ in getattr(p, name).most_common():
        sp, sr = p.share(name, key), ref.share(name, key)
        if sp >= MIN_SHARE and sp - sr >= MIN_LEAD:
            out.append((key, sp - sr))
    return sorted(out, key=lambda kv: (-kv[1], str(kv[0])))


def distinctive_words(p: Profile, ref: Profile, n: int = N_WORDS) -> list[str]:
    """Context words frequent in p and rare in ref (smoothed log ratio of context frequencies, in >= 2 contexts)."""
    scored = []
    for w, c in p.words.items():
        if c < MIN_CONTEXTS:
            continue
        ratio = np.log((c + 0.5) / (p.n + 1)) - np.log((ref.words[w] + 0.5) / (ref.n + 1))
        if ratio > 0.5:
            scored.append((-ratio * np.sqrt(c), w))
    return [_spelling(p, w) for _, w in sorted(scored)[:n]]


def _source_phrase(p: Profile) -> str | None:
    if not p.n or not p.source:
        return None
    source, count = min(p.source.items(), key=lambda kv: (-kv[1], kv[0]))
    if count / p.n < 0.5:
        return None
    phrase = SOURCE_PHRASES.get(source, f"{source} text")
    topics = sorted(((n, t) for (s, t), n in p.topic.items() if s == source and n >= 2), key=lambda x: (-x[0], x[1]))
    if topics and topics[0][0] / p.n >= 0.2:
        phrase += f" ({', '.join(t for _, t in topics[:2])})"
    return phrase


def what_separates(p: Profile, q: Profile, q_id: int) -> str:
    """A short contrast of two sibling profiles: the facts that lead in each, e.g.
    "this: after 'of', Bible verse (Numbers) · #12: before 'LORD', near Moses"."""

    def facts(a: Profile, b: Profile) -> list[str]:
        out = []
        for name, fmt in (("prev", "after {}"), ("next", "before {}"), ("position", "{}")):
            lead = _lead(a, b, name)
            if lead:
                key = lead[0][0]
                out.append(fmt.format(key if name == "position" else quote(str(key))))
        src = _source_phrase(a)
        if src and src != _source_phrase(b):
            out.append(src)
        words = distinctive_words(a, b, 2)
        if words:
            out.append("near " + ", ".join(words))
        return out[:2]

    mine, theirs = facts(p, q), facts(q, p)
    return (f"this: {', '.join(mine) or 'no clear difference'} · #{q_id}: "
            f"{', '.join(theirs) or 'no clear difference'}")[:160]


# ----------------------------------------------------------------------------------------------------------------
# Candidate labels.


def _display(core: str) -> str:
    return "line break" if not core else quote(core)


def heads(card: PrototypeCard) -> list[str]:
    """Ways to name the tokens: by kind ("determiner 'the'", "suffix -eth (saith)", "prepositions (of, in)") and
    bare ("'the'", "'Today'/'Let'/'Now'"); several unrelated tokens are listed, not called mixed.

    A word counts once in any case ("Today" and "today"), and of tokens seen equally often the one with the stronger
    evidence (the lower rank) comes first, never the alphabetically first: a bare head lists the commonest tokens
    until they cover BARE_COVER of the evidence (at most BARE_MAX, each after the first seen at least twice), so
    it names what most contexts show."""
    kinds = [token_kind(e.context_tokens[e.token_index], e.context_tokens, e.token_index) for e in card.evidence]
    n = len(kinds)
    cores = _first_ranked(k.core.lower() for k in kinds)
    spelling = {key: _first_ranked(k.core for k in kinds if k.core.lower() == key)[0][0] for key, _ in cores}
    top, n_top = cores[0]
    kind, n_kind = _first_ranked(k.kind for k in kinds)[0]
    out = []
    if kind in ("suffix", "inner", "prefix") and n_kind / n >= 0.6:
        phrase = OfflineLabeler._piece_phrase(kind, [k for k in kinds if k.kind == kind])
        out.append(phrase.split(" (")[0] if len(phrase) > 40 else phrase)
    elif n_top / n >= 0.5:
        top_kind = next(k for k in kinds if k.core.lower() == top)
        singular = KIND_PHRASES[top_kind.kind][1]
        out.append(singular if top_kind.kind == "whitespace" else f"{singular} {_display(top_kind.example)}")
    elif n_kind / n >= 0.6:
        examples = [c for c, _ in _first_ranked(k.example for k in kinds if k.kind == kind)[:3]]
        out.append(f"{KIND_PHRASES[kind][0]} ({', '.join(e or 'line break' for e in examples)})")
    named, covered = [], 0
    for key, count in cores[:BARE_MAX]:
        if named and count < 2:
            break  # a token seen once says nothing about the rest
        named.append(_display(spelling[key]))
        covered += count
        if covered / n >= BARE_COVER:
            break
    bare = "/".join(named)
    if bare not in out:
        out.append(bare)
    return out


def _first_ranked(items) -> list[tuple[str, int]]:
    """[(item, count)] commonest first; equal counts in the order first seen (evidence comes strongest first)."""
    counts: Counter = Counter()
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        counts[item] += 1
        first.setdefault(item, i)
    return sorted(counts.items(), key=lambda kv: (-kv[1], first[kv[0]]))


def modifiers(p: Profile, ref: Profile, card: PrototypeCard, background: Profile | None = None) -> dict[str, str]:
    """Named facts that set p apart from ref (siblings, or all evidence when there are none); with background,
    also the context words that set it apart from other prototypes in general ("topic")."""
    mods: dict[str, str] = {}
    for name, fmt in (("prev", "after {}"), ("next", "before {}")):
        lead = _lead(p, ref, name)
        if lead:
            mods[name] = fmt.format(_display(str(lead[0][0])) if lead[0][0] != "line break" else "a line break")
    lead = _lead(p, ref, "position")
    if lead:
        mods["position"] = {"line start": "at line start", "sentence start": "at sentence start",
                            "before punctuation": "before punctuation"}[lead[0][0]]
    src = _source_phrase(p)
    if src:
        mods["source"] = f"in {src}"
    words = distinctive_words(p, ref)
    if words:
        mods["words"] = "near " + ", ".join(words)
    if background is not None:
        topic = distinctive_words(p, background)
        if topic and topic[:len(words)] != words:
            mods["topic"] = "near " + ", ".join(topic)
    ranked = sorted(p.words.items(), key=lambda kv: (-kv[1], kv[0]))[:N_WORDS]
    common = [_spelling(p, w) for w, c in ranked if c >= MIN_CONTEXTS]
    if common and common != words:
        mods["common"] = "with " + ", ".join(common)
    promoted = [t for t, v in card.logit_tokens if v > 0 and t.strip()]
    if promoted:
        mods["promotes"] = f"predicting {quote(promoted[0])}"
    return mods


_COMBOS = (("words",), ("source",), ("prev",), ("next",), ("position",), ("promotes",), ("prev", "words"),
           ("next", "words"), ("source", "words"), ("position", "words"), ("prev", "source"), ("next", "source"),
           ("position", "source"), ("prev", "next"), ("prev", "source", "words"), ("next", "source", "words"),
           ("promotes", "words"), ("source", "promotes"), ("topic",), ("prev", "topic"), ("next", "topic"),
           ("source", "topic"), ("position", "topic"), ("common",), ("prev", "common"), ("next", "common"),
           ("source", "common"))


def candidates(heads_: list[str], mods: dict[str, str]) -> list[str]:
    """Head + modifier combinations of at most MAX_LABEL_CHARS, in a fixed order (earlier wins ties)."""
    out = list(heads_)
    for head in heads_:
        for combo in _COMBOS:
            if not all(m in mods for m in combo):
                continue
            parts = [mods[m] for m in combo]
            text = " ".join([head, *parts])
            words = next((combo.index(m) for m in ("words", "topic", "common") if m in combo), None)
            while len(text) > MAX_LABEL_CHARS and words is not None and parts[words].count(","):
                parts[words] = parts[words].rsplit(",", 1)[0]  # drop the last word until it fits
                text = " ".join([head, *parts])
            if len(text) <= MAX_LABEL_CHARS:
                out.append(text)
    return list(dict.fromkeys(out))


# ----------------------------------------------------------------------------------------------------------------
# The job's shared context: every card, every context embedded once, the siblings.


@dataclass
class ContrastContext:
    """What the labels job computes once per run (and again, identically, when it resumes)."""

    cards: dict[int, PrototypeCard]  # every prototype of prototype_stats, all evidence
    siblings: dict[int, list[tuple[int, float]]]
    documents: dict[str, tuple[str, str | None]]
    index: dict[tuple[int, int], int]  # (prototype_id, rank) -> row of vectors
    vectors: np.ndarray  # (N, D) every evidence context window, L2-normalised
    select_rows: np.ndarray  # (S,) rows of vectors: visible contexts that candidates are chosen against
    select_ids: np.ndarray  # (S,) their prototypes
    profiles: dict[int, Profile] = field(default_factory=dict)  # visible (even-ranked) evidence per prototype
    background: Profile | None = None  # see _background
    facts: list = field(default_factory=list)  # detection.row_facts: what the marked scorer reads off each row

    def rows(self, pid: int, held_out: bool) -> list[int]:
        """Rows of a prototype's visible (even) or held-out (odd) evidence contexts."""
        card = self.cards.get(pid)
        if card is None:
            return []
        part = card.evidence[1::2] if held_out else card.evidence[0::2]
        return [self.index[(pid, e.rank)] for e in part]

    def sibling_ids(self, pid: int) -> list[int]:
        return [s for s, _ in self.siblings.get(pid, [])]

    def sibling_profile(self, pid: int) -> Profile:
        ref = Profile()
        for s in self.sibling_ids(pid):
            ref.add(self.profiles[s])
        return ref


def build_context(con: duckdb.DuckDBPyConnection, pool: NegativePool, seed: int = 0,
                  n_select: int = N_SELECT) -> ContrastContext:
    """Load every card, embed every evidence context once (one call, fixed order), find the siblings and draw the
    selection sample: seeded, visible (even-ranked) contexts only, none of the rows the label_score pool holds."""
    ids = [r[0] for r in con.execute("SELECT prototype_id FROM prototype_stats ORDER BY prototype_id").fetchall()]
    cards = {c.prototype_id: c for c in load_cards(con, ids)}
    documents = {d: (s, t) for d, s, t in con.execute("SELECT doc_id, source, title FROM documents").fetchall()}
    keys = [(pid, e.rank) for pid in ids for e in cards[pid].evidence]
    texts = [e.window() for pid in ids for e in cards[pid].evidence]
    logger.info("contrast: embedding %d evidence contexts", len(texts))
    vectors = embed(texts)  # (N, D)
    index = {k: i for i, k in enumerate(keys)}
    pool_keys = set(zip(pool.prototype_ids.tolist(), pool.ranks.tolist()))  # the held-out score's negatives
    visible = np.array([i for i, key in enumerate(keys) if key[1] % 2 == 0 and key not in pool_keys],
                       dtype=np.int64)
    if not len(visible):  # a database so small that the pool holds every visible context: share them
        visible = np.array([i for i, key in enumerate(keys) if key[1] % 2 == 0], dtype=np.int64)
    rng = np.random.default_rng(seed + 1)
    select = np.sort(rng.choice(visible, size=min(n_select, len(visible)), replace=False)) if len(visible) else \
        np.zeros(0, np.int64)
    ctx = ContrastContext(cards=cards, siblings=sibling_pairs(con), documents=documents, index=index,
                          vectors=vectors, select_rows=select,
                          select_ids=np.array([keys[i][0] for i in select], dtype=np.int64))
    ctx.profiles = {pid: profile(cards[pid].evidence[0::2], documents) for pid in ids}
    return ctx


def score_pair(ctx: ContrastContext, pool: NegativePool, pid: int, label_vector: np.ndarray
               ) -> tuple[float | None, float | None]:
    """(label_score, sibling_score) of one label vector (D,) on the prototype's held-out contexts."""
    held = ctx.rows(pid, held_out=True)
    if not held:
        return None, None
    positives = ctx.vectors[held] @ label_vector  # (h,)
    others = pool.vectors[pool.prototype_ids != pid] if len(pool.prototype_ids) else pool.vectors[:0]
    label_score = auroc(positives, others @ label_vector) if len(others) else None
    sib_rows = [r for s in ctx.sibling_ids(pid) for r in ctx.rows(s, held_out=True)]
    sibling_score = auroc(positives, ctx.vectors[sib_rows] @ label_vector) if sib_rows else None
    return label_score, sibling_score


def score_labels(ctx: ContrastContext, pool: NegativePool, items: list[tuple[int, str]]
                 ) -> list[tuple[float | None, float | None]]:
    """(label_score, sibling_score) for each (prototype_id, label); detection.score_labels adds the detection
    scores."""
    if not items:
        return []
    vectors = embed([label for _, label in items])  # (L, D)
    return [score_pair(ctx, pool, pid, v) for (pid, _), v in zip(items, vectors, strict=True)]


def separations(ctx: ContrastContext, pid: int) -> list[tuple[int, int, int, float, str]]:
    """label_siblings rows of one prototype: (prototype_id, rank, sibling_id, overlap, separation)."""
    p = ctx.profiles.get(pid, Profile())
    return [(pid, rank, sid, overlap, what_separates(p, ctx.profiles.get(sid, Profile()), sid))
            for rank, (sid, overlap) in enumerate(ctx.siblings.get(pid, []))]


# ----------------------------------------------------------------------------------------------------------------
# The labeler.


class ContrastiveLabeler:
    """Labeler v2 (module docstring): offline, deterministic, contrastive to the siblings, distinct labels.

    The category comes from the token rules and category descriptions of OfflineLabeler (v1). prepare_contrast
    plans every prototype's label at once (so labels can be kept distinct); label(card) returns the plan's label for
    a planned prototype and plans a lone card (no distinctness) otherwise.
    """

    name = "offline-v2"
    model_id = EMBED_MODEL

    def __init__(self) -> None:
        self._v1 = OfflineLabeler()
        self._ctx: ContrastContext | None = None
        self._plan: dict[int, tuple[str, str]] = {}  # prototype_id -> (label, explanation)

    def prepare(self, background: np.ndarray) -> None:
        self._v1.prepare(background)

    def prepare_contrast(self, ctx: ContrastContext) -> None:
        """Choose every prototype's label: candidates scored on visible evidence, best untaken one wins."""
        self._ctx = ctx
        options = {}
        for n, (pid, card) in enumerate(sorted(ctx.cards.items())):
            if card.evidence:
                options[pid] = self._options(ctx, card)
            if n % 128 == 127:
                logger.info("contrast: planned %d/%d prototypes", n + 1, len(ctx.cards))
        self._plan = distinct_choice(options)

    def _options(self, ctx: ContrastContext, card: PrototypeCard) -> list[tuple[float, str, str]]:
        """[(train objective, label, explanation)] best first, for a card with its full evidence in ctx."""
        pid = card.prototype_id
        texts, vectors, mods = candidate_set(ctx, card)
        out = []
        for i, (text, (a_rand, a_sib)) in enumerate(zip(texts, visible_scores(ctx, pid, vectors), strict=True)):
            objective = RANDOM_WEIGHT * a_rand + (1 - RANDOM_WEIGHT) * a_sib - 1e-6 * i  # earlier ones win ties
            siblings = ", ".join(f"#{s}" for s in ctx.sibling_ids(pid)[:6])
            explanation = (f"visible-evidence AUROC {a_rand:.2f} vs other prototypes, {a_sib:.2f} vs siblings"
                           + (f" ({siblings}: prototypes on the same tokens)" if siblings else " (no siblings)")
                           + ("; contrasts: " + "; ".join(f"{k} = {v}" for k, v in mods.items()) if mods else ""))
            out.append((objective, text, explanation))
        return sorted(out, key=lambda o: -o[0])

    def label(self, card: PrototypeCard) -> LabelResult:
        base = self._v1.label(card)  # category (and the inactive case)
        if not card.evidence:
            return base
        if card.prototype_id in self._plan:
            label, explanation = self._plan[card.prototype_id]
        elif self._ctx is not None and card.prototype_id in self._ctx.cards:
            _, label, explanation = self._options(self._ctx, self._ctx.cards[card.prototype_id])[0]
        else:  # no job context (a lone card): v1's label without its catch-all wording
            label, explanation = base.label.replace("mixed tokens", "tokens"), base.explanation
        return LabelResult(base.category, label, f"{explanation}; category: {base.explanation}"[:600])


def candidate_set(ctx: ContrastContext, card: PrototypeCard) -> tuple[list[str], np.ndarray, dict[str, str]]:
    """A card's candidate labels, built from its visible evidence only: (texts, their embeddings (C, D), the
    modifiers they were built from)."""
    pid = card.prototype_id
    visible = replace_evidence(card, card.evidence[0::2])
    background = _background(ctx, pid)
    ref = ctx.sibling_profile(pid) if ctx.sibling_ids(pid) else background
    mods = modifiers(ctx.profiles[pid], ref, visible, background if ctx.sibling_ids(pid) else None)
    texts = candidates(heads(visible), mods)
    return texts, embed(texts, progress=False), mods


def visible_scores(ctx: ContrastContext, pid: int, vectors: np.ndarray) -> list[tuple[float, float]]:
    """(AUROC vs the selection sample, AUROC vs the siblings) of each label vector (C, D) on the prototype's visible
    contexts: what the labeler chooses by (the sibling one falls back to the first without siblings)."""
    pos = ctx.vectors[ctx.rows(pid, held_out=False)]  # (v, D)
    rand = ctx.vectors[ctx.select_rows[ctx.select_ids != pid]]  # (S', D)
    sib = ctx.vectors[[r for s in ctx.sibling_ids(pid) for r in ctx.rows(s, held_out=False)]]  # (s, D)
    out = []
    for v in vectors:
        a_rand = auroc(pos @ v, rand @ v) if len(pos) and len(rand) else 0.5
        out.append((a_rand, auroc(pos @ v, sib @ v) if len(pos) and len(sib) else a_rand))
    return out


def replace_evidence(card: PrototypeCard, evidence: list[EvidenceContext]) -> PrototypeCard:
    from dataclasses import replace

    return replace(card, evidence=evidence)


def _background(ctx: ContrastContext, pid: int) -> Profile:
    """The reference of "in general": the visible profiles of (up to 64 of) the selection sample's prototypes."""
    if ctx.background is None:
        ctx.background = Profile()
        for other in sorted(set(ctx.select_ids.tolist()))[:64]:
            ctx.background.add(ctx.profiles[other])
    return ctx.background


def distinct_choice(options: dict[int, list[tuple[float, str, str]]]) -> dict[int, tuple[str, str]]:
    """Give each prototype its best-scoring candidate that no other prototype took: all (objective, prototype,
    candidate) triples in order of objective (ties: lower id, earlier candidate), first come first served. A
    prototype whose every candidate is taken keeps its best one (a duplicate)."""
    order = sorted(((obj, pid, i) for pid, opts in options.items() for i, (obj, _, _) in enumerate(opts)),
                   key=lambda t: (-t[0], t[1], t[2]))
    taken: set[str] = set()
    plan: dict[int, tuple[str, str]] = {}
    for _, pid, i in order:
        if pid in plan:
            continue
        _, text, explanation = options[pid][i]
        if text not in taken:
            plan[pid] = (text, explanation)
            taken.add(text)
    for pid, opts in options.items():
        if pid not in plan and opts:
            plan[pid] = (opts[0][1], opts[0][2])
    return plan
