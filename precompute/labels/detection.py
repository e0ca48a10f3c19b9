"""Detection scores: given a label, tell the prototype's contexts from others (issue 37), as the field scores
feature explanations (a scorer reads the explanation and decides, context by context, whether the feature fires).

The offline scorer is the sentence embedding: a context is called the prototype's when cos(label, context) is at
least a threshold. The threshold is fitted on the visible (even-ranked) evidence the labeler saw, against the
visible negatives it chose by; the score is the **balanced accuracy** (mean of the hit rate on the prototype's
held-out, odd-ranked contexts and the correct-rejection rate on held-out negatives) with that threshold, so nothing
that is scored was used to label or to fit:

    detection_random    negatives: the seeded pool of other prototypes' contexts (never in the labeler's sample)
    detection_sibling   negatives: the siblings' held-out contexts (prototypes on the same tokens; hard negatives)

0.5 is chance, 1.0 a perfect detector. Unlike AUROC it charges for a threshold that does not carry over from the
evidence the label was made on to the evidence it was not.

The explanation-free check (intruder_accuracy): among N_INTRUDER_SET held-out contexts of a prototype and one
context of another, the one least similar to the rest is picked as the intruder; the share of prototypes where that
is the true intruder says how coherent the evidence is without any label (chance 1 / (N_INTRUDER_SET + 1)).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from precompute.embed import embed
from precompute.labels.contrast import ContrastContext, score_pair
from precompute.labels.scoring import NegativePool
from precompute.labels.tokens import KIND_PHRASES, token_kind

N_INTRUDER_SET = 4  # held-out contexts shown with the intruder
TOKEN_WEIGHT = 0.4  # the marked scorer: weight of "the marked token is the one the label names"
CONTEXT_WEIGHT = 0.4  # ... and of the label's other claims (chosen on the visible split of the shipped database)


def fit_threshold(positives: np.ndarray, negatives: np.ndarray) -> float:
    """The threshold t maximising balanced accuracy of `score >= t` on (P,) positives and (N,) negatives: the
    midpoint of the best gap between consecutive distinct scores (ties: the lowest such t)."""
    pos, neg = np.asarray(positives, np.float64), np.asarray(negatives, np.float64)
    if not len(pos) or not len(neg):
        raise ValueError("a threshold needs at least one positive and one negative")
    values = np.unique(np.concatenate([pos, neg]))  # sorted
    cuts = np.concatenate([[values[0] - 1.0], (values[:-1] + values[1:]) / 2.0, [values[-1] + 1.0]])  # (U+1,)
    tpr = (pos[None, :] >= cuts[:, None]).mean(axis=1)
    tnr = (neg[None, :] < cuts[:, None]).mean(axis=1)
    return float(cuts[int(np.argmax((tpr + tnr) / 2.0))])


def balanced_accuracy(positives: np.ndarray, negatives: np.ndarray, threshold: float) -> float:
    """(hit rate on positives + correct-rejection rate on negatives) / 2 of `score >= threshold`."""
    pos, neg = np.asarray(positives, np.float64), np.asarray(negatives, np.float64)
    if not len(pos) or not len(neg):
        raise ValueError("balanced accuracy needs at least one positive and one negative")
    return float(((pos >= threshold).mean() + (neg < threshold).mean()) / 2.0)


def detection_scores(ctx: ContrastContext, pool: NegativePool, pid: int, label: str, label_vector: np.ndarray,
                     marked: bool = True) -> tuple[float | None, float | None]:
    """(detection_random, detection_sibling) of one label (its text and embedding (D,)); None where a side has no
    contexts. marked: the marked scorer (the label's claims and the embedding), else the embedding alone."""
    visible, held = ctx.rows(pid, held_out=False), ctx.rows(pid, held_out=True)
    if not visible or not held:
        return None, None
    claims = parse_claims(label) if marked else Claims()

    def score(rows) -> np.ndarray:
        return marked_scores(ctx, claims, label_vector, rows) if marked else \
            ctx.vectors[np.asarray(rows, dtype=np.int64)] @ label_vector

    pos_fit, pos_test = score(visible), score(held)
    rand_fit = score(ctx.select_rows[ctx.select_ids != pid])
    rand_test = score(pool_rows(ctx, pool)[pool.prototype_ids != pid])
    random = (balanced_accuracy(pos_test, rand_test, fit_threshold(pos_fit, rand_fit))
              if len(rand_fit) and len(rand_test) else None)
    sib_fit = [r for s in ctx.sibling_ids(pid) for r in ctx.rows(s, held_out=False)]
    sib_test = [r for s in ctx.sibling_ids(pid) for r in ctx.rows(s, held_out=True)]
    sibling = (balanced_accuracy(pos_test, score(sib_test), fit_threshold(pos_fit, score(sib_fit)))
               if sib_fit and sib_test else None)
    return random, sibling


def score_labels(ctx: ContrastContext, pool: NegativePool, items: list[tuple[int, str]]) -> list[tuple]:
    """(label_score, sibling_score, detection_random, detection_sibling) for each (prototype_id, label): v2's two
    AUROCs (contrast.score_pair) and the two detection accuracies, from one embedding of each label."""
    if not items:
        return []
    vectors = embed([label for _, label in items])  # (L, D)
    return [score_pair(ctx, pool, pid, v) + detection_scores(ctx, pool, pid, label, v)
            for (pid, label), v in zip(items, vectors, strict=True)]


def pool_rows(ctx: ContrastContext, pool: NegativePool) -> np.ndarray:
    """The rows of ctx that hold the pool's contexts (the pool is drawn from the same evidence table)."""
    return np.array([ctx.index[(int(p), int(r))] for p, r in zip(pool.prototype_ids, pool.ranks, strict=True)],
                    dtype=np.int64)


def intruder_accuracy(ctx: ContrastContext, pool: NegativePool, seed: int = 0,
                      n_set: int = N_INTRUDER_SET) -> tuple[float, int]:
    """(share of prototypes whose intruder is found, prototypes tried): module docstring. Seeded."""
    rng = np.random.default_rng(seed)
    hits = tried = 0
    for pid in sorted(ctx.cards):
        held = ctx.rows(pid, held_out=True)
        others = np.flatnonzero(pool.prototype_ids != pid)
        if len(held) < n_set or not len(others):
            continue
        members = ctx.vectors[rng.choice(held, size=n_set, replace=False)]  # (n, D)
        intruder = pool.vectors[int(rng.choice(others))]  # (D,)
        items = np.vstack([members, intruder[None, :]])  # (n+1, D); the intruder is last
        sims = items @ items.T
        np.fill_diagonal(sims, 0.0)
        hits += int(np.argmin(sims.sum(axis=1)) == n_set)
        tried += 1
    return (hits / tried if tried else 0.0), tried


# ----------------------------------------------------------------------------------------------------------------
# The marked scorer: the label's claims checked on a context whose evidence token is marked.

_QUOTED = re.compile(r"(?:(after|before|predicting)\s+)?'([^']*)'")
_LIST = re.compile(r"\b(near|with)\s+([^→;()]+?)(?=\s+(?:in|at|after|before|near|with|predicting)\s|\s*→|$)")
_KIND_BY_PHRASE = sorted(((phrase, kind) for kind, phrases in KIND_PHRASES.items() for phrase in phrases),
                         key=lambda pk: -len(pk[0]))
_POSITIONS = {"at line start": "line start", "at sentence start": "sentence start",
              "before punctuation": "before punctuation"}


@dataclass
class Claims:
    """What a label says, in the terms a marked context can be checked against."""

    tokens: set[str] = field(default_factory=set)  # the marked token (stripped, lower case; "" a line break)
    kinds: set[str] = field(default_factory=set)  # ... or its kind (tokens.token_kind)
    suffixes: set[str] = field(default_factory=set)  # "suffix -eth": a word piece ending so
    prefixes: set[str] = field(default_factory=set)  # "word start sp-"
    after: set[str] = field(default_factory=set)  # the piece before it
    before: set[str] = field(default_factory=set)  # the piece after it: "before 'X'", the pushes side, predicting
    before_kinds: set[str] = field(default_factory=set)
    words: list[str] = field(default_factory=list)  # context words: "near A, B", "with A, B"
    positions: set[str] = field(default_factory=set)


def _core(text: str) -> str:
    text = text.strip().lower()
    return "" if text in ("line break", "a line break") else text.replace("’", "'")


def parse_claims(label: str) -> Claims:
    """The claims of a label of labelers v1 to v3 ("fires_on → pushes"; v2's "predicting 'X'" is a push)."""
    fires, _, pushes = label.partition("→")
    c = Claims()
    for where, token in _QUOTED.findall(fires):
        target = {"after": c.after, "before": c.before, "predicting": c.before}.get(where, c.tokens)
        target.add(_core(token))
    if re.search(r"\bafter a line break\b", fires):
        c.after.add("")
    head = re.split(r"\s(?:after|before|near|with|in|at|predicting)\s", " " + fires.strip() + " ", maxsplit=1)[0]
    for phrase, kind in _KIND_BY_PHRASE:
        if re.search(rf"\b{re.escape(phrase)}\b", head):
            c.kinds.add(kind)
            listed = re.search(rf"{re.escape(phrase)} \(([^)]*)\)", head)
            if listed and kind not in ("suffix", "prefix", "inner"):
                c.tokens.update(_core(t) for t in listed.group(1).split(","))
            break
    c.suffixes.update(m.lower() for m in re.findall(r"suffix -(\w+)", head))
    c.prefixes.update(m.lower() for m in re.findall(r"word start (\w+)-", head))
    if "line break" in head and not c.tokens and not c.kinds:
        c.tokens.add("")
    for _, words in _LIST.findall(fires):
        c.words += [w.strip().lower() for w in words.split(",") if w.strip()]
    c.positions.update(v for k, v in _POSITIONS.items() if k in fires)
    for token in re.findall(r"'([^']*)'", pushes):
        c.before.add(_core(token))
    if "a line break" in pushes:
        c.before.add("")
    listed = re.match(r"\s*([^(]+?) \(([^)]*)\)", pushes)
    if listed:
        kind = next((k for p, k in _KIND_BY_PHRASE if p == listed.group(1).strip()), None)
        if kind:
            c.before_kinds.add(kind)
        c.before.update(_core(t) for t in listed.group(2).split(","))
    return c


@dataclass(frozen=True)
class Facts:
    """What the marked scorer reads off one context (computed once per context)."""

    core: str  # the marked token, stripped, lower case
    kind: str  # its token kind
    prev: str | None  # the piece before it (None at the context's start)
    next: str | None  # the piece after it
    next_kind: str | None
    words: frozenset  # lower-case words of the window
    positions: frozenset  # line start | sentence start | before punctuation


def context_facts(e) -> Facts:
    """Facts of an EvidenceContext (its token_index is the marked token)."""
    i, pieces = e.token_index, e.context_tokens
    own = pieces[i]
    before = pieces[i - 1] if i > 0 else ""
    nxt = pieces[i + 1] if i + 1 < len(pieces) else None
    at = set()
    if "\n" in before + own[:len(own) - len(own.lstrip())]:
        at.add("line start")
    if before.strip().endswith((".", "!", "?", ":", ";")):
        at.add("sentence start")
    if nxt is not None and nxt.strip()[:1] and nxt.strip()[:1] in ",.;:!?)]\"”":
        at.add("before punctuation")
    return Facts(core=_core(own), kind=token_kind(own, pieces, i).kind, prev=_core(before) if i > 0 else None,
                 next=_core(nxt) if nxt is not None else None,
                 next_kind=token_kind(nxt, pieces, i + 1).kind if nxt is not None else None,
                 words=frozenset(_WORDS.findall(e.window().lower())), positions=frozenset(at))


def claim_features(claims: Claims, f: Facts) -> tuple[float, float]:
    """(token match, context match) of a marked context's Facts against a label's claims, in [0, 1]: the marked
    token is a named token (1) or of the named kind (0.5); the context match is the mean over the other claims the
    label makes (the piece before, the piece after, the place in the line, the share of named context words
    present), 0 when it makes none."""
    if f.core in claims.tokens or any(f.core.endswith(x) for x in claims.suffixes) or \
            any(f.core.startswith(x) for x in claims.prefixes):
        token = 1.0
    elif f.kind in claims.kinds:
        token = 0.5
    else:
        token = 0.0
    parts = []
    if claims.after:
        parts.append(float(f.prev is not None and f.prev in claims.after))
    if claims.before or claims.before_kinds:
        parts.append(float(f.next is not None and (f.next in claims.before or f.next_kind in claims.before_kinds)))
    if claims.words:
        parts.append(sum(w in f.words for w in claims.words) / len(claims.words))
    if claims.positions:
        parts.append(float(bool(f.positions & claims.positions)))
    return token, (sum(parts) / len(parts) if parts else 0.0)


_WORDS = re.compile(r"[a-z0-9][a-z0-9'’-]*")


def row_facts(ctx: ContrastContext) -> list[Facts]:
    """Facts of every context row of ctx (computed once, kept on the context)."""
    if len(ctx.facts) != len(ctx.vectors):
        rows: list[Facts | None] = [None] * len(ctx.vectors)
        for pid, card in ctx.cards.items():
            for e in card.evidence:
                rows[ctx.index[(pid, e.rank)]] = context_facts(e)
        ctx.facts = rows
    return ctx.facts


def marked_scores(ctx: ContrastContext, claims: Claims, vector: np.ndarray, rows) -> np.ndarray:
    """The marked scorer on context rows: cos(label, context) + TOKEN_WEIGHT x token match + CONTEXT_WEIGHT x
    context match (claim_features)."""
    rows = np.asarray(rows, dtype=np.int64)
    if not len(rows):
        return np.zeros(0)
    facts = row_facts(ctx)
    features = np.array([claim_features(claims, facts[r]) for r in rows])  # (n, 2)
    return ctx.vectors[rows] @ vector + TOKEN_WEIGHT * features[:, 0] + CONTEXT_WEIGHT * features[:, 1]
