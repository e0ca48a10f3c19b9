"""Labeler v1 ('offline-v1'): deterministic labels without a network, token rules first and sentence-embedding
similarity to written descriptions of each category for content words (the class docstring has the steps).
Labeler v2 (contrast.py) takes its categories from it.

    labeler = OfflineLabeler()
    labeler.prepare(background_vectors)          # calibration against the embedded negative contexts
    result = labeler.label(card)                 # LabelResult(category, label, explanation)
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from precompute.embed import EMBED_MODEL, embed
from precompute.labels.cards import PrototypeCard
from precompute.labels.labeler import MAX_LABEL_CHARS, LabelResult
from precompute.labels.tokens import KIND_PHRASES, TokenKind, quote, token_kind
from precompute.schema import CATEGORIES

# Semantic categories: (specific role, a rich description with examples). Rule categories (morphology, grammatical
# scaffolding) are decided by the token rules alone: a sentence embedding says little about a word piece.
CATEGORY_DESCRIPTIONS: dict[str, list[tuple[str, str]]] = {
    "medical/bio": [
        ("medicine and disease", "medicine and health: disease, illness, symptoms, diagnosis, treatment, patients, "
                                 "doctors, nurses, hospital, clinic, infection, cancer"),
        ("anatomy", "the human body: heart, blood, lungs, brain, bones, muscles, skin, organs, nerves, tissue"),
        ("biology", "biology: cells, genes, DNA, proteins, bacteria, viruses, species, organisms, evolution, "
                    "enzymes, molecules of life"),
        ("drugs and therapy", "drugs and therapy: medication, dose, vaccine, surgery, clinical trial, "
                              "prescription, antibiotics"),
    ],
    "institutional": [
        ("government and politics", "government and politics: parliament, congress, ministry, president, election, "
                                    "minister, party, policy, state, council"),
        ("law and courts", "law and justice: court, judge, statute, act, regulation, legal, lawsuit, police, "
                           "rights, constitution"),
        ("organisations", "organisations and institutions: university, school, committee, association, "
                          "department, agency, board, federation, society, commission"),
        ("military", "the military: army, navy, troops, regiment, war, battle, general, soldiers, officers"),
    ],
    "numbers/time": [
        ("numbers and quantities", "numbers and quantities: one, two, three, 12, 450, hundred, thousand, million, "
                                   "percent, half, dozens"),
        ("dates and time", "dates and time: years, months, days, weeks, centuries, 1843, January, Monday, ago, "
                           "later, period, season"),
    ],
    "science/tech": [
        ("science", "science: physics, chemistry, mathematics, energy, theory, experiment, research, equation, "
                    "atoms, laboratory"),
        ("computing and technology", "technology and computing: software, computer, data, internet, code, "
                                     "algorithm, device, network, engineering, electronics"),
    ],
    "named entities": [
        ("person names", "names of people: John, Mary, Smith, Napoleon, Shakespeare, Elizabeth, Mr. Brown"),
        ("place names", "names of places: London, Paris, France, America, Thames, Everest, cities, countries, "
                        "rivers and regions"),
        ("organisation names", "names of companies, teams and brands: Google, the BBC, Microsoft, Ford, "
                               "Manchester United"),
    ],
    "social": [
        ("people and family", "people and relationships: family, mother, father, children, friends, marriage, "
                              "love, neighbours, community"),
        ("culture and daily life", "culture and everyday life: music, art, sport, food, games, fashion, "
                                   "holidays, feelings, education"),
        ("religion", "religion and faith: God, Lord, church, prayer, worship, heaven, priest, holy, sin, spirit"),
    ],
    "boilerplate": [
        ("web boilerplate", "website boilerplate: copyright, all rights reserved, privacy policy, cookies, terms "
                            "of use, subscribe, sign in, click here, share, menu"),
        ("markup and references", "markup and references: html tags, wiki markup, category, references, external "
                                  "links, retrieved, citation needed, ISBN"),
    ],
    "environment": [
        ("nature", "nature and landscape: trees, forest, river, sea, mountains, animals, birds, plants, flowers, "
                   "weather, rain, snow"),
        ("climate and ecology", "climate and ecology: climate change, pollution, emissions, conservation, "
                                "wildlife, habitat, environment"),
        ("farming", "farming and land: crops, soil, harvest, cattle, sheep, fields, farmers, agriculture"),
    ],
    "urls": [
        ("web addresses", "web addresses and links: http, https, www, .com, .org, email addresses, file paths, "
                          "domain names"),
    ],
    "finance": [
        ("money and prices", "money and prices: price, cost, dollars, pounds, payment, tax, income, wages, debt, "
                             "rent"),
        ("business and markets", "business and markets: company, shares, stock market, investment, bank, profit, "
                                 "revenue, trade, economy, sales"),
    ],
}
SEMANTIC_CATEGORIES = tuple(CATEGORY_DESCRIPTIONS)
RULE_MAJORITY = 0.5  # a rule category with at least this share of the (weighted) tokens decides the category
SEMANTIC_MIN = 0.02  # calibrated similarity below which a content prototype is 'misc'
SEMANTIC_AGREEMENT = 0.5  # share of content words that must agree with the winning category, else 'misc'
NEXT_WEIGHT = 0.3  # weight of the next-token distribution relative to the evidence tokens
LOGIT_WEIGHT = 0.3  # weight of the logit signature (top promoted tokens)
SCAFFOLDING_DISCOUNT = 0.5  # function words and punctuation follow almost any token: weak evidence when they do
N_LOGIT_TOKENS = 10
SCAFFOLDING = "grammatical scaffolding"
# A prototype on function words whose prediction (next tokens and logit signature, averaged) is at least this share of
# one non-scaffolding kind is a slot: 'the' before place names, 'in' before years. Its category is what it predicts
# when that is clear (a rule category with this share, or a semantic field that passes SEMANTIC_MIN with at least
# SLOT_AGREEMENT of the predicted words agreeing: overriding a rule majority needs more than SEMANTIC_AGREEMENT);
# otherwise it stays grammatical scaffolding.
SLOT_SHARE = 0.6
SLOT_AGREEMENT = 0.7
SLOT_RULE_CATEGORIES = ("numbers/time", "finance", "urls", "boilerplate")  # token-rule fields a slot can predict


def _shares(kinds: list[TokenKind], weights: list[float]) -> Counter:
    total = sum(weights)
    shares: Counter = Counter()
    for k, w in zip(kinds, weights, strict=True):
        shares[k.category] += w / total if total else 0.0
    return shares


class OfflineLabeler:
    """Deterministic labels without a network: token rules first, sentence-embedding semantics for content words.

    1. Every evidence token is classified by rules (token_kind): URL, currency, number/date/time, punctuation,
       word piece (a token inside a longer word: morphology), archaic form, function word, boilerplate; anything
       else is a content word. Next tokens (weight NEXT_WEIGHT) and the logit signature (LOGIT_WEIGHT) are
       classified the same way and added, weighted, to the evidence's shares (function words and punctuation at
       half weight there: they follow, and are promoted after, almost any token).
    2. A rule category with a majority of the weight is the category, except that a function-word prototype whose
       prediction is one field is a slot (_slot: 'the' before place names is place names, 'in' before years is
       numbers/time; SLOT_SHARE and SLOT_AGREEMENT say when). Otherwise, when content words weigh at
       least as much as the largest rule category, the evidence contexts and the list of evidence tokens are
       embedded and compared with written descriptions of each semantic category (CATEGORY_DESCRIPTIONS), minus
       each description's mean similarity to background contexts (`prepare`), so that a description close to
       everything does not win everywhere. A weak best match, or rule kinds without a majority, give 'misc'.
    3. The label is the dominant role's phrase plus the dominant tokens ("year numbers (1843, 1850)",
       "suffix -tion", "preposition 'of' after 'out'"; a slot: "place names (Egypt, Israel) after 'of'"), the
       explanation gives the shares behind it.
    """

    name = "offline-v1"
    model_id = EMBED_MODEL

    def __init__(self) -> None:
        self._roles: list[tuple[str, str]] = [(c, role) for c, items in CATEGORY_DESCRIPTIONS.items()
                                              for role, _ in items]
        self._descriptions: np.ndarray | None = None  # (R, D)
        self._bias = np.zeros(len(self._roles), dtype=np.float32)  # (R,)

    def _description_vectors(self) -> np.ndarray:
        if self._descriptions is None:
            texts = [text for items in CATEGORY_DESCRIPTIONS.values() for _, text in items]
            self._descriptions = embed(texts)  # (R, D)
        return self._descriptions

    def prepare(self, background: np.ndarray) -> None:
        """Calibrate against background context vectors (N, D): each role's mean similarity to them is removed."""
        if len(background):
            self._bias = (background @ self._description_vectors().T).mean(axis=0).astype(np.float32)  # (R,)

    def label(self, card: PrototypeCard) -> LabelResult:
        if not card.evidence:
            promoted = ", ".join(quote(t) for t, v in card.logit_tokens[:3] if v > 0)
            return LabelResult("misc", "inactive prototype", "no evidence: the prototype was never among the top-k"
                               + (f"; it promotes {promoted}" if promoted else ""))
        ev_kinds = [token_kind(e.context_tokens[e.token_index], e.context_tokens, e.token_index)
                    for e in card.evidence]
        next_kinds = [token_kind(t) for t, _ in card.next_tokens]
        logit = [(t, v) for t, v in card.logit_tokens if v > 0][:N_LOGIT_TOKENS]
        logit_kinds = [token_kind(t) for t, _ in logit]

        combined = _shares(ev_kinds, [1.0] * len(ev_kinds))
        total_weight = 1.0
        for kinds, weights, w in ((next_kinds, [float(n) for _, n in card.next_tokens], NEXT_WEIGHT),
                                  (logit_kinds, [1.0] * len(logit_kinds), LOGIT_WEIGHT)):
            if kinds:
                for c, s in _shares(kinds, weights).items():
                    combined[c] += w * s * (SCAFFOLDING_DISCOUNT if c == "grammatical scaffolding" else 1.0)
                total_weight += w
        for c in combined:
            combined[c] /= total_weight
        rule = max((c for c in combined if c is not None), key=lambda c: (combined[c], -CATEGORIES.index(c)),
                   default=None)
        rule_share = combined[rule] if rule else 0.0
        content_share = combined[None]

        semantic_note, role = "", None
        slot_words: list[str] = []
        if rule is not None and rule_share >= RULE_MAJORITY:
            category = rule
            if rule == SCAFFOLDING:
                slot = self._slot(card, next_kinds, logit, logit_kinds)
                if slot is not None:
                    category, role, semantic_note, slot_words = slot
        elif content_share > 0 and content_share >= rule_share:
            category, role, score, agreement = self._semantic(card, ev_kinds)
            semantic_note = f"; closest description: {role} ({score:+.3f}, {agreement:.0%} of the words agree)"
            if score < SEMANTIC_MIN or agreement < SEMANTIC_AGREEMENT:
                category, role = "misc", None
        else:  # no majority and mostly rule tokens of several kinds: a mixed prototype
            category = "misc"

        if slot_words:  # what it predicts, and the function word it sits on
            top = Counter(k.core.lower() for k in ev_kinds).most_common(1)[0][0]
            where = quote(top) if top else "a line break" if any("\n" in e.token for e in card.evidence) else "a space"
            label = f"{role or category} ({', '.join(slot_words[:3])}) after {where}"[:MAX_LABEL_CHARS]
        else:
            label = self._phrase(card, ev_kinds, next_kinds, category, role)
        parts = [f"{c or 'content words'} {s:.0%}" for c, s in combined.most_common(3)]
        top = ", ".join(f"{quote(t)}×{n}" for t, n in card.activating_tokens[:4])
        explanation = f"token shares: {', '.join(parts)}{semantic_note}; top evidence tokens {top}"
        if card.next_tokens:
            explanation += "; followed by " + ", ".join(quote(t) for t, _ in card.next_tokens[:3])
        if logit:
            explanation += "; promotes " + ", ".join(quote(t) for t, _ in logit[:3])
        return LabelResult(category, label, explanation)

    def _slot(self, card: PrototypeCard, next_kinds: list[TokenKind], logit: list[tuple[str, float]],
              logit_kinds: list[TokenKind]) -> tuple[str, str | None, str, list[str]] | None:
        """(category, role or None, explanation note, predicted words) for a function-word prototype whose
        prediction is one field, else None (it stays grammatical scaffolding). SLOT_SHARE has the rule.

        The final state at a token is mostly about the token that follows, and its slice W p_i is a push on those
        next tokens, so 'the' before place names is about places in what it does, not about the determiner.
        """
        shares: list[Counter] = []
        if next_kinds:
            shares.append(_shares(next_kinds, [float(n) for _, n in card.next_tokens]))
        if logit_kinds:
            shares.append(_shares(logit_kinds, [1.0] * len(logit_kinds)))
        if not shares:
            return None
        predicted: Counter = Counter()
        for share in shares:
            for c, v in share.items():
                predicted[c] += v / len(shares)
        pairs = list(zip([t for t, _ in card.next_tokens] + [t for t, _ in logit], next_kinds + logit_kinds,
                         strict=True))
        for c in SLOT_RULE_CATEGORIES:
            if predicted[c] >= SLOT_SHARE:
                words = list(dict.fromkeys(k.example for _, k in pairs if k.category == c))
                kind = Counter(k.kind for _, k in pairs if k.category == c).most_common(1)[0][0]
                return c, KIND_PHRASES[kind][0], f"; slot: predicts {c} {predicted[c]:.0%}", words
        if predicted[None] < SLOT_SHARE:
            return None
        words = list(dict.fromkeys(k.word or k.core for _, k in pairs if k.category is None and (k.word or k.core)))
        # each evidence context with its own next token, where that is a content word, as one scored item
        items = []
        for e in card.evidence:
            j = e.token_index + 1
            if j < len(e.context_tokens):
                k = token_kind(e.context_tokens[j], e.context_tokens, j)
                if k.category is None and (k.word or k.core):
                    items.append((e.window(), k.word or k.core))
        items = items or [(w, w) for w in words]
        if not items or not words:
            return None
        category, role, score, agreement = self._score_semantic(
            [w for w, _ in items], [w for _, w in items], [False] * len(items), words)
        if score < SEMANTIC_MIN or agreement < SLOT_AGREEMENT:
            return None
        note = (f"; slot: predicts content words {predicted[None]:.0%}, closest description {role} ({score:+.3f}, "
                f"{agreement:.0%} of the predicted words agree)")
        return category, role, note, words

    def _semantic(self, card: PrototypeCard, kinds: list[TokenKind]) -> tuple[str, str, float, float]:
        """(category, role, calibrated score, agreement) of the best semantic role for the evidence's content words.

        Each content word is scored by its context window and by the word alone; the role's score is the mean of
        those and the similarity to the list of words; agreement is the share of words whose own best category
        is the winner's (a random mix of words scores something somewhere, but its words disagree).
        """
        pairs = [(e, k) for e, k in zip(card.evidence, kinds, strict=True) if k.category is None]
        pairs = pairs or list(zip(card.evidence, kinds, strict=True))
        words = [k.word or k.core for _, k in pairs]
        return self._score_semantic([e.window() for e, _ in pairs], words,
                                    [k.kind == "proper noun" for _, k in pairs], words)

    def _score_semantic(self, windows: list[str], words: list[str], proper: list[bool],
                        listed: list[str]) -> tuple[str, str, float, float]:
        """_semantic's scoring: item i is windows[i] and words[i] (proper[i]: a capitalised word mid-sentence),
        plus one embedding of the first 12 distinct `listed` words."""
        n = len(windows)
        vectors = embed(windows + words + [", ".join(dict.fromkeys(listed[:12]))])  # (2n+1, D)
        sims = vectors @ self._description_vectors().T - self._bias  # (2n + 1, R)
        items = 0.5 * sims[:n] + 0.5 * sims[n:2 * n]  # (n, R)
        names = np.array([c == "named entities" for c, _ in self._roles])  # (R,)
        items = items + 0.05 * np.outer(np.array(proper, dtype=bool), names)  # a capitalised word: often a name
        scores = 0.5 * items.mean(axis=0) + 0.5 * sims[-1]  # (R,)
        best = int(np.argmax(scores))
        category, role = self._roles[best]
        agreement = float(np.mean([self._roles[int(i)][0] == category for i in items.argmax(axis=1)]))
        return category, role, float(scores[best]), agreement

    def _phrase(self, card: PrototypeCard, ev_kinds: list[TokenKind], next_kinds: list[TokenKind], category: str,
                role: str | None) -> str:
        if role is not None:  # a semantic category: the content words name it
            chosen = [k for k in ev_kinds if k.category is None] or ev_kinds
        else:
            chosen = [k for k in ev_kinds if k.category == category] or ev_kinds
        examples = Counter(k.example if k.kind == "proper noun" else k.example.lower() for k in chosen)
        (top, top_n), n = examples.most_common(1)[0], len(chosen)
        kind = Counter(k.kind for k in chosen).most_common(1)[0][0]
        if role is not None:
            shown = [top] if top_n / n >= 0.6 else [e for e, _ in examples.most_common(3)]
            label = f"{role}: {', '.join(shown)}"
        elif category == "misc":
            label = f"mixed tokens ({', '.join(quote(e) for e, _ in examples.most_common(3))})"
        elif kind in ("suffix", "inner", "prefix"):
            label = self._piece_phrase(kind, chosen)
        elif top_n / n >= 0.6:
            label = f"{KIND_PHRASES[kind][1]} {quote(top)}"
        else:
            label = f"{KIND_PHRASES[kind][0]} ({', '.join(e for e, _ in examples.most_common(3))})"
        if kind in ("archaic pronoun",):  # the role is the label; the words go to the explanation
            label = KIND_PHRASES[kind][1 if top_n / n >= 0.6 else 0]
        return (label + self._qualifier(card, next_kinds, category))[:MAX_LABEL_CHARS]

    @staticmethod
    def _piece_phrase(kind: str, kinds: list[TokenKind]) -> str:
        pieces = Counter(k.core.lower() for k in kinds)
        words = ", ".join(dict.fromkeys(k.word.lower() for k in kinds if k.word and k.word != k.core))
        words = f" ({words})" if words else ""
        if len(words) > 40:
            words = words[:words.rfind(",", 0, 40)] + ")"
        total = sum(pieces.values())
        if kind == "suffix":  # a shared ending of the pieces (-tion from 'tion', 'ation', 'ition') names a suffix
            for length in (5, 4, 3, 2):
                ends = Counter(c[-length:] for c in pieces.elements() if len(c) >= length)
                if ends and ends.most_common(1)[0][1] / total >= 0.6:
                    return f"suffix -{ends.most_common(1)[0][0]}{words}"
        top, count = pieces.most_common(1)[0]
        if kind == "prefix" and count / total >= 0.6:
            return f"word start {top}-{words}"
        return f"{KIND_PHRASES[kind][0]} ({', '.join(p for p, _ in pieces.most_common(3))})"

    @staticmethod
    def _qualifier(card: PrototypeCard, next_kinds: list[TokenKind], category: str) -> str:
        """'after X' when one preceding token dominates, else 'before Y' from the next-token distribution."""
        prev = Counter(e.previous_token.strip().lower() for e in card.evidence if e.previous_token.strip())
        if prev and len(card.evidence) >= 3:
            token, count = prev.most_common(1)[0]
            if count / len(card.evidence) >= 0.6:
                return f" after {quote(token)}"
        total = sum(n for _, n in card.next_tokens)
        if total:
            token, count = card.next_tokens[0]
            if count / total >= 0.5 and token.strip():
                return f" before {quote(token)}"
            weights = Counter()
            for (_, n), k in zip(card.next_tokens, next_kinds, strict=True):
                weights[k.kind if k.category not in (None, category) else None] += n
            kind, count = weights.most_common(1)[0]
            if kind is not None and count / total >= 0.6:
                return f" before {KIND_PHRASES[kind][0]}"
        return ""
