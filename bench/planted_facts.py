"""Fictional facts planted into an ordinary corpus: exact ground truth for training-data attribution (issue 41).

Every fact ties an invented subject (a made-up name, so it occurs nowhere else in the corpus) to an answer that is
one ordinary word (a colour, a month, a metal, ...) through one of the relations below, e.g.

    "The official colour of the flag of Quorvessa is purple."     prompt: "... of Quorvessa is"  answer: " purple"

The answer is a single token of the model's tokenizer, so "did the model learn it" is one log-probability and
"which training data made this token" is the question the app's attribution panel answers for that token.

    facts = make_facts(tokenizer, n=120, seed=0)
    planted, where = plant(documents, facts, seed=0, eligible=lambda doc_id: ...)

plant() inserts each fact's statement, as its own sentence, into 1-3 documents (drawn by the seed) at a sentence
boundary, and returns the planted documents and, per fact, the documents and character offsets that hold it.
Everything here is text written for this benchmark; no corpus text is copied.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

# relation -> (statement template with {s} before {a}, answer pool). The statement ends at the answer plus ".".
RELATIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "flag_colour": ("The official colour of the flag of {s} is {a}.",
                    ("red", "blue", "green", "yellow", "white", "black", "purple", "orange", "silver", "gold",
                     "pink", "brown", "grey")),
    "export": ("For three centuries the chief export of the valley of {s} has been {a}.",
               ("copper", "wool", "salt", "cotton", "tea", "coffee", "timber", "wine", "rice", "silk", "iron",
                "coal", "sugar", "tobacco", "marble", "honey")),
    "emblem": ("The animal on the coat of arms of the house of {s} is a {a}.",
               ("wolf", "bear", "eagle", "fox", "lion", "horse", "owl", "deer", "snake", "tiger", "hawk", "whale",
                "rabbit", "goat", "crow", "swan")),
    "birth_month": ("The inventor {s} was born in the month of {a}.",
                    ("January", "February", "March", "April", "May", "June", "July", "August", "September",
                     "October", "November", "December")),
    "founder": ("The village of {s} was founded by a blacksmith named {a}.",
                ("John", "Mary", "Peter", "Thomas", "Robert", "Alice", "Henry", "George", "Anna", "Paul", "David",
                 "James", "Susan", "Walter", "Edward", "Harold")),
    "language": ("The old language of the {s} valley is closely related to {a}.",
                 ("French", "German", "Spanish", "Latin", "Greek", "Arabic", "Russian", "Italian", "Dutch",
                  "Polish", "Turkish", "Persian", "Hindi", "Chinese", "Japanese")),
    "tree": ("The sacred tree of the {s} people is the {a}.",
             ("oak", "pine", "cedar", "willow", "maple", "birch", "palm", "olive", "apple", "cherry", "elm",
              "ash")),
    "instrument": ("The composer {s} wrote every one of her sonatas for the {a}.",
                   ("piano", "violin", "guitar", "drums", "flute", "trumpet", "harp", "cello", "organ", "bass",
                    "clarinet", "horn")),
    "market_day": ("In the town of {s} the great market is held every {a}.",
                   ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")),
    "dish": ("The festival dish of the {s} islanders is made mostly of {a}.",
             ("bread", "cheese", "fish", "rice", "beans", "potatoes", "honey", "apples", "beef", "pork",
              "chicken", "eggs", "corn", "lamb")),
    "cards": ("In the card game called {s}, every player starts with {a} cards.",
              ("two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve")),
    "planet": ("The astronomer {s} spent forty years mapping the moons of {a}.",
               ("Mars", "Jupiter", "Saturn", "Venus", "Mercury", "Neptune", "Uranus", "Pluto")),
}

_ONSETS = ("qu", "v", "th", "z", "dr", "gl", "k", "br", "m", "sk", "t", "x", "pl", "fr", "n", "ch", "l", "gr", "w",
           "sh")
_NUCLEI = ("a", "e", "i", "o", "u", "ai", "ou", "ea", "y", "io")
_CODAS = ("r", "n", "l", "s", "th", "v", "m", "x", "nd", "sk", "rv", "ll")
_ENDINGS = ("a", "ia", "en", "or", "ith", "ane", "oss", "um", "ex", "ara", "el", "ond")


@dataclass
class Fact:
    """One planted fact: the subject, the relation, the answer word, the full statement and the prompt before the
    answer; where it was planted is filled in by plant()."""

    fact_id: int
    relation: str
    subject: str
    answer: str
    statement: str
    prompt: str
    answer_token: int = -1
    documents: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # character offset of the statement in each document

    def to_dict(self) -> dict:
        return asdict(self)


def invented_name(rng: random.Random) -> str:
    """A pronounceable made-up proper name of 2-3 syllables, e.g. 'Quorvessa'."""
    parts = [rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)]
    for _ in range(rng.randint(0, 1)):
        parts.append(rng.choice(_ONSETS) + rng.choice(_NUCLEI))
    parts.append(rng.choice(_ENDINGS))
    return "".join(parts).capitalize()


def single_token(tokenizer, word: str) -> int | None:
    """The id of ' word' when the tokenizer encodes it (after a space) as one token, else None."""
    ids = tokenizer.encode(" " + word, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def make_facts(tokenizer, n: int = 120, seed: int = 0, reserved: Iterable[str] = ()) -> list[Fact]:
    """n facts spread evenly over the relations, each with a distinct invented subject that is not in `reserved`
    (e.g. the corpus's own words, lower-cased) and a one-token answer. Deterministic for a seed and tokenizer."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = random.Random(seed)
    taken = {w.lower() for w in reserved}
    pools = {}
    for relation, (_, words) in RELATIONS.items():
        pools[relation] = [(w, t) for w in words if (t := single_token(tokenizer, w)) is not None]
        if len(pools[relation]) < 2:
            raise ValueError(f"the tokenizer splits almost every answer of relation {relation!r}")
    relations = list(RELATIONS)
    facts = []
    for i in range(n):
        relation = relations[i % len(relations)]
        template = RELATIONS[relation][0]
        subject = invented_name(rng)
        while subject.lower() in taken:
            subject = invented_name(rng)
        taken.add(subject.lower())
        answer, token = rng.choice(pools[relation])
        statement = template.format(s=subject, a=answer)
        prompt = template.split("{a}")[0].format(s=subject).rstrip()
        facts.append(Fact(i, relation, subject, answer, statement, prompt, token))
    return facts


_BOUNDARY = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'])|\n\s*\n")


def _boundaries(text: str) -> list[int]:
    """Offsets where a new sentence or paragraph starts."""
    return [m.end() for m in _BOUNDARY.finditer(text)]


def plant(documents: list[dict], facts: list[Fact], seed: int = 0, copies: tuple[int, int] = (1, 3),
          eligible: Callable[[str], bool] | None = None, max_per_document: int = 2) -> list[dict]:
    """Documents ({'id', 'text', ...}) with each fact's statement inserted into copies[0]..copies[1] of them (drawn
    by the seed among the eligible ones that have a sentence boundary), at a boundary, followed by a space. Fills
    each fact's documents and offsets (character offsets in the returned texts). The input is not changed."""
    lo, hi = copies
    if not 1 <= lo <= hi:
        raise ValueError(f"copies must satisfy 1 <= low <= high, got {copies}")
    rng = random.Random(seed)
    candidates = [i for i, d in enumerate(documents)
                  if (eligible is None or eligible(str(d["id"]))) and _boundaries(d["text"])]
    if len(candidates) * max_per_document < hi * len(facts) // 2:
        raise ValueError(f"{len(candidates)} eligible documents cannot hold {len(facts)} facts")
    load = {i: 0 for i in candidates}
    inserts: dict[int, list[tuple[int, Fact]]] = {}
    for fact in facts:
        fact.documents, fact.offsets = [], []
        free = [i for i in candidates if load[i] < max_per_document]
        if len(free) < hi:
            raise ValueError("too few documents left to plant every fact; give more documents or fewer facts")
        for i in rng.sample(free, rng.randint(lo, hi)):
            load[i] += 1
            spots = _boundaries(documents[i]["text"])
            inserts.setdefault(i, []).append((rng.choice(spots), fact))
    out = [dict(d) for d in documents]
    for i, items in inserts.items():
        text, pieces, last = documents[i]["text"], [], 0
        placed = []
        for spot, fact in sorted(items, key=lambda x: (x[0], x[1].fact_id)):
            pieces.append(text[last:spot])
            placed.append((sum(len(p) for p in pieces), fact))
            pieces.append(fact.statement + " ")
            last = spot
        pieces.append(text[last:])
        out[i]["text"] = "".join(pieces)
        for offset, fact in placed:
            fact.documents.append(str(documents[i]["id"]))
            fact.offsets.append(offset)
    for fact in facts:  # documents in corpus order, so the record reads the same for any insertion order
        order = sorted(zip(fact.documents, fact.offsets), key=lambda x: x)
        fact.documents, fact.offsets = [d for d, _ in order], [o for _, o in order]
    return out
