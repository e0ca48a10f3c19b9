"""The labels job: a broad category, a short specific role and a held-out score for every prototype.

PRISM.md sections 2 and 5: the paper's interpretability pipeline gives each prototype a broad category from its
taxonomy (schema.CATEGORIES: morphology, grammatical scaffolding, medical/bio, ...) and a specific role ("archaic
2nd-person pronoun", "year numbers", "suffix -tion"). One row per prototype of prototype_stats goes into `labels`:

    category      one of schema.CATEGORIES
    label         a few words naming the specific role
    label_score   AUROC of cos(label embedding, context embedding) separating the prototype's HELD-OUT evidence
                  contexts (odd ranks; the label is made from the even ranks only) from a seeded sample of other
                  prototypes' contexts: 0.5 = the label says nothing about the evidence, 1.0 = it singles it out
    sibling_score AUROC of the same similarity separating the held-out evidence from the held-out evidence of the
                  prototype's siblings only (prototypes whose evidence shares its tokens; precompute/contrast.py):
                  does the label single it out among prototypes on the same tokens? NULL without siblings
    labeler       which labeler wrote it; explanation: why, in one or two sentences

The siblings themselves, with a short "what separates them", go into `label_siblings`.

Labelers share one small interface (`name`, `label(card) -> LabelResult`):
    ContrastiveLabeler        the default ('offline', v2, precompute/contrast.py): deterministic, no network; names
                              what sets a prototype apart from its siblings (words before and after, position,
                              source and topic, distinctive context words, the promoted token); distinct labels
    OfflineLabeler            'offline-v1': token rules + sentence-embedding similarity to written descriptions of
                              each category (v2 takes its categories from it)
    OpenAICompatibleLabeler   any OpenAI-style /chat/completions endpoint (a local vLLM or llama.cpp server, ...)
    LocalInstructLabeler      a transformers instruct model in a local folder (never downloads)

Usage:
    python -m precompute.labels --db out.duckdb
    python -m precompute.labels --db out.duckdb --labeler offline-v1
    python -m precompute.labels --db out.duckdb --labeler openai --endpoint http://127.0.0.1:8000/v1 --llm-model qwen
    python -m precompute.labels --db out.duckdb --labeler local --llm-model path/to/instruct-model

The job is resumable: prototypes are labelled in id order, in chunks, and each chunk's rows are written together
with its progress in one transaction, so a killed job that is started again writes exactly the rows an
uninterrupted run writes. Its arguments (labeler, seed, ...) are stored; other arguments need --overwrite.
For tests, the environment variable PRISM_CHUNK_SLEEP_S (precompute.runs.SLEEP_ENV) holds each chunk's
transaction open that many seconds (after the rows are written, before the commit) so a test can kill the job
mid-transaction.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol, runtime_checkable

import duckdb
import numpy as np
from tqdm.auto import tqdm

from precompute.embed import EMBED_DIM, EMBED_MODEL, embed
from precompute.runs import (
    JobArgsMismatch,
    connect,
    finish_job,
    job_done,
    job_run_id,
    remaining_prototypes,
    start_job,
    write_chunk,
)
from precompute.schema import CATEGORIES

logger = logging.getLogger("precompute.labels")

JOB = "labels"
WINDOW_BEFORE = 16  # context tokens before the evidence token in an embedded context (activation depends on these)
WINDOW_AFTER = 2  # and after it (what the prototype helps predict)
N_NEGATIVES = 256  # random contexts of other prototypes that held-out evidence is scored against
MAX_LABEL_CHARS = 80


class LabelerError(RuntimeError):
    """A labeler could not produce a label (endpoint down, HTTP error, unusable replies after a retry)."""


# ----------------------------------------------------------------------------------------------------------------
# Prototype cards: what a labeler sees, gathered from the evidence job's tables.


def clean_token(token: str) -> str:
    """A token as text: byte-level BPE markers (Ġ space, Ċ newline, ▁ sentencepiece space) become characters."""
    if any(mark in token for mark in "ĠĊĉ▁"):
        token = token.replace("Ġ", " ").replace("Ċ", "\n").replace("ĉ", "\t").replace("▁", " ")
    return token


@dataclass
class EvidenceContext:
    """One top-activating token of a prototype, with the context the evidence job stored around it."""

    rank: int
    token: str  # the evidence token as its context piece (with the space before it, if any)
    activation: float
    context_tokens: list[str]  # pieces that join to the document text: each token with the gap before it
    context_activations: list[float]  # this prototype's activation at each context token
    token_index: int  # index of the evidence token in context_tokens
    doc_id: str = ""

    def window(self, before: int = WINDOW_BEFORE, after: int = WINDOW_AFTER) -> str:
        """The context around the evidence token as plain text (what gets embedded)."""
        lo, hi = max(0, self.token_index - before), self.token_index + after + 1
        return "".join(self.context_tokens[lo:hi]).strip()

    def marked(self, before: int = 40, after: int = 8) -> str:
        """The context with the evidence token in «guillemets» (what an LLM labeler reads)."""
        lo, hi = max(0, self.token_index - before), self.token_index + after + 1
        left = "".join(self.context_tokens[lo:self.token_index])
        right = "".join(self.context_tokens[self.token_index + 1:hi])
        text = f"{left}«{self.context_tokens[self.token_index]}»{right}"
        return " ".join(text.split())

    @property
    def previous_token(self) -> str:
        return self.context_tokens[self.token_index - 1] if self.token_index > 0 else ""


@dataclass
class PrototypeCard:
    """Everything the labelers know about one prototype."""

    prototype_id: int
    evidence: list[EvidenceContext]  # highest activation first
    next_tokens: list[tuple[str, int]] = field(default_factory=list)  # (token, count) that follow the evidence
    logit_tokens: list[tuple[str, float]] = field(default_factory=list)  # (token, (W p_i)[token]), by rank
    activation_count: int = 0
    mean_activation: float | None = None
    max_activation: float | None = None

    @property
    def activating_tokens(self) -> list[tuple[str, int]]:
        """Evidence tokens with their counts, most frequent first (ties: highest-ranked first)."""
        return Counter(e.token for e in self.evidence).most_common()

    def split(self) -> tuple[PrototypeCard, list[EvidenceContext]]:
        """(card with the even-ranked evidence, the odd-ranked evidence held out for scoring the label)."""
        return replace(self, evidence=self.evidence[0::2]), self.evidence[1::2]


def load_cards(con: duckdb.DuckDBPyConnection, prototype_ids: Sequence[int]) -> list[PrototypeCard]:
    """Cards for the given prototypes (in the given order), read from the evidence job's tables."""
    ids = [int(i) for i in prototype_ids]
    if not ids:
        return []
    lo, hi, wanted = min(ids), max(ids), set(ids)
    cards = {i: PrototypeCard(prototype_id=i, evidence=[]) for i in ids}
    for pid, count, mean, top in con.execute(
            "SELECT prototype_id, activation_count, mean_activation, max_activation FROM prototype_stats "
            "WHERE prototype_id BETWEEN ? AND ?", [lo, hi]).fetchall():
        if pid in wanted:
            cards[pid].activation_count, cards[pid].mean_activation, cards[pid].max_activation = int(count), mean, top
    for row in con.execute(f"SELECT {_EVIDENCE_COLUMNS} {_EVIDENCE_FROM} WHERE e.prototype_id BETWEEN ? AND ? "
                           "ORDER BY e.prototype_id, e.rank", [lo, hi]).fetchall():
        if row[0] in wanted:
            context = _evidence(*row[1:])
            if context is not None:
                cards[row[0]].evidence.append(context)
    for pid, token, count in con.execute(
            "SELECT prototype_id, token, count FROM next_tokens WHERE prototype_id BETWEEN ? AND ? "
            "ORDER BY prototype_id, rank", [lo, hi]).fetchall():
        if pid in wanted:
            cards[pid].next_tokens.append((clean_token(token), int(count)))
    for pid, token, value in con.execute(
            "SELECT prototype_id, token, value FROM logit_signatures WHERE prototype_id BETWEEN ? AND ? "
            "ORDER BY prototype_id, rank", [lo, hi]).fetchall():
        if pid in wanted:
            cards[pid].logit_tokens.append((clean_token(token), float(value)))
    return [cards[i] for i in ids]


# The evidence row plus the stretch of its document that the context covers (one character more in front, for
# the first token's leading space), so contexts are rebuilt from the text instead of trusting token strings.
_EVIDENCE_COLUMNS = """e.prototype_id, e.rank, e.doc_id, e.token_position, e.context_start, e.activation, e.token,
    e.context_tokens, e.context_activations, e.context_char_starts, e.context_char_ends, d.sha256,
    greatest(coalesce(list_min(e.context_char_starts), e.char_start) - 1, 0) AS text_offset,
    substr(d.text, greatest(coalesce(list_min(e.context_char_starts), e.char_start) - 1, 0) + 1,
           coalesce(list_max(e.context_char_ends), e.char_end)
           - greatest(coalesce(list_min(e.context_char_starts), e.char_start) - 1, 0)) AS text"""
_EVIDENCE_FROM = "FROM evidence e LEFT JOIN documents d USING (doc_id)"


def context_pieces(text: str, offset: int, starts: Sequence[int], ends: Sequence[int]) -> list[str]:
    """Context tokens as text pieces that join to the document text: each token's characters plus the gap before
    it (tokenizer offsets usually leave a token's leading space out). text starts at character `offset`."""
    pieces, cursor = [], None
    for a, b in zip(starts, ends, strict=True):
        a, b = a - offset, b - offset
        if cursor is None:  # the first token keeps one leading whitespace character, if the text has one
            cursor = a - 1 if a > 0 and text[a - 1].isspace() else a
        pieces.append(text[cursor:b] if b > cursor else "")
        cursor = max(cursor, b)
    return pieces


@functools.lru_cache(maxsize=1024)
def _document_text(doc_id: str, sha256: str | None) -> str | None:
    """A pointer-only database's document text from the installed corpus (checked against its sha256)."""
    if sha256 is None:
        return None
    try:
        from precompute.corpus import check_text

        return check_text(doc_id, sha256)
    except (ImportError, KeyError, ValueError, OSError) as err:
        logger.warning("no text for document %r: %s", doc_id, err)
        return None


def _evidence(rank, doc_id, position, start, activation, token, tokens, acts, starts, ends, sha256, text_offset,
              text) -> EvidenceContext | None:
    """One evidence row as an EvidenceContext; None when neither its text nor its token strings are available."""
    if text is None and not tokens and starts:  # pointer-only: read the document from the installed corpus
        full = _document_text(doc_id, sha256)
        if full is not None:
            text = full[text_offset:max(ends)]
    if text is not None and starts and len(starts) == len(ends):
        pieces = context_pieces(text, text_offset, starts, ends)
    elif tokens:  # no text: the stored token strings, a space where the offsets leave a gap
        pieces = [clean_token(t) for t in tokens]
        if starts and len(starts) == len(pieces) == len(ends):
            pieces = [(" " if i and starts[i] > ends[i - 1] and not p[:1].isspace() else "") + p
                      for i, p in enumerate(pieces)]
    else:
        return None
    index = int(position) - int(start)
    if not 0 <= index < len(pieces):  # inconsistent offsets: fall back to the context's peak activation
        if not len(acts):
            return None
        index = int(np.argmax(acts))
    return EvidenceContext(rank=int(rank), token=pieces[index] or clean_token(token), activation=float(activation),
                           context_tokens=pieces, context_activations=[float(a) for a in acts], token_index=index,
                           doc_id=str(doc_id))


# ----------------------------------------------------------------------------------------------------------------
# The labeler interface.


@dataclass(frozen=True)
class LabelResult:
    category: str  # one of CATEGORIES
    label: str  # a few words
    explanation: str = ""


@runtime_checkable
class Labeler(Protocol):
    name: str  # stored in labels.labeler and in the job's arguments

    def label(self, card: PrototypeCard) -> LabelResult: ...


def _category_key(text: str) -> str:
    text = text.lower().replace("&", " ").replace(" and ", " ")
    return re.sub(r"[^a-z]", "", text)


_CATEGORY_KEYS = {_category_key(c): c for c in CATEGORIES}


def normalize_category(raw: str) -> str | None:
    """A category as a labeler wrote it ("Medical & Bio", "URLs", "numbers and time") -> CATEGORIES, or None."""
    key = _category_key(str(raw))
    if not key:
        return None
    if key in _CATEGORY_KEYS:
        return _CATEGORY_KEYS[key]
    for known, category in _CATEGORY_KEYS.items():
        if key.rstrip("s") == known.rstrip("s") or (known == "misc" and key.startswith("misc")):
            return category
    return None


# ----------------------------------------------------------------------------------------------------------------
# Token rules: closed classes that need no semantics (numbers, URLs, punctuation, function words, word pieces).

_MONTHS = {"january", "february", "march", "april", "may", "june", "july", "august", "september", "october",
           "november", "december", "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov",
           "dec"}
_AMBIGUOUS_MONTHS = {"may", "march", "mar", "jan", "dec", "sep", "oct", "nov", "jun", "jul", "aug", "apr", "feb"}
_WEEKDAYS = {"monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"}
_TIME_WORDS = {"second", "seconds", "minute", "minutes", "hour", "hours", "day", "days", "week", "weeks", "month",
               "months", "year", "years", "decade", "decades", "century", "centuries", "today", "yesterday",
               "tomorrow", "ago", "morning", "evening", "night", "tonight", "o'clock", "am", "pm", "daily", "weekly",
               "annual", "annually", "era"}
_NUMBER_WORDS = {"one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
                 "thirteen", "fifteen", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty",
                 "ninety", "hundred", "hundreds", "thousand", "thousands", "million", "millions", "billion",
                 "trillion", "dozen", "first", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth",
                 "tenth", "half", "twice", "thrice"}
_CURRENCY_WORDS = {"dollar", "dollars", "usd", "euro", "euros", "eur", "gbp", "yen", "cents", "cent", "shilling",
                   "shillings", "pence", "rupees", "yuan"}
_CURRENCY_SYMBOLS = set("$€£¥₹")
_ARCHAIC_PRONOUNS = {"thee", "thou", "thy", "thine", "ye"}
_ARCHAIC_FORMS = {"hath", "doth", "hast", "dost", "shalt", "wilt", "saith", "spake", "unto", "thereof", "wherefore",
                  "whence", "thither", "hither", "behold", "verily", "begat", "art", "didst", "wast", "shouldest"}
_FUNCTION_WORDS = {
    "determiner": {"the", "a", "an", "this", "that", "these", "those", "some", "any", "each", "every", "no",
                   "all", "both", "either", "neither", "such", "another", "other"},
    "preposition": {"of", "in", "on", "at", "to", "for", "with", "by", "from", "into", "onto", "upon", "about",
                    "over", "under", "between", "through", "during", "before", "after", "against", "without",
                    "within", "among", "across", "toward", "towards", "behind", "beyond", "near", "since", "until",
                    "via", "per", "around", "along", "above", "below", "beside", "besides", "throughout"},
    "conjunction": {"and", "or", "but", "nor", "so", "yet", "if", "because", "although", "though", "while",
                    "whereas", "unless", "whether", "than", "as", "when", "where", "whereby"},
    "pronoun": {"i", "me", "my", "mine", "you", "your", "yours", "he", "him", "his", "she", "her", "hers", "it",
                "its", "we", "us", "our", "ours", "they", "them", "their", "theirs", "who", "whom", "whose",
                "which", "what", "myself", "yourself", "himself", "herself", "itself", "ourselves", "themselves"},
    "auxiliary verb": {"is", "are", "was", "were", "be", "been", "being", "am", "do", "does", "did", "have", "has",
                       "had", "will", "would", "shall", "should", "can", "could", "may", "might", "must"},
    "particle": {"not", "n't", "there", "here", "then", "also", "very", "too", "just", "only", "up", "out", "off",
                 "down", "s", "'s", "’s", "t", "ll", "re", "ve", "d"},
}
_BOILERPLATE_WORDS = {"copyright", "©", "cookie", "cookies", "privacy", "subscribe", "unsubscribe", "newsletter",
                      "login", "signup", "advertisement", "disclaimer", "reserved", "trademark", "™", "®",
                      "javascript", "browser", "sitemap", "retrieved", "isbn"}
_URL = re.compile(r"(https?:|://|www\.|\.(com|org|net|edu|gov|io|co|uk|de|html?|php|aspx?|pdf)\b|@[a-z0-9-]+\.)",
                  re.IGNORECASE)
_YEAR = re.compile(r"(1[5-9]\d\d|20[0-4]\d)(s)?")
_NUMBER = re.compile(r"[\d.,:/%\-]*\d[\d.,:/%\-]*")
_SENTENCE_END = (".", "!", "?", "\n", ":", '"', "“")


@dataclass(frozen=True)
class TokenKind:
    """What the rules make of one token: a category (None = a content word, left to semantics) and a finer role."""

    category: str | None
    kind: str  # a key of _KIND_PHRASES
    core: str  # the token without surrounding whitespace
    word: str = ""  # the whole word (letters and digits) the token is part of, e.g. '1843' for the piece '4'

    @property
    def example(self) -> str:
        """How the token is shown in a label: numbers and content words whole, pieces and function words as is."""
        whole = self.category in ("numbers/time", "finance", "urls") or self.category is None
        return (self.word or self.core) if whole else self.core


# kind -> (plural phrase for several tokens, singular phrase for one dominant token)
_KIND_PHRASES = {
    "url": ("URL pieces", "URL piece"),
    "currency": ("currency names and symbols", "currency"),
    "money": ("money amounts", "money amount"),
    "year": ("year numbers", "year"),
    "clock time": ("clock times", "clock time"),
    "percentage": ("percentages", "percentage"),
    "date": ("dates", "date"),
    "number": ("numbers", "number"),
    "number word": ("number words", "number word"),
    "month": ("month names", "month name"),
    "weekday": ("weekday names", "weekday name"),
    "time word": ("time words", "time word"),
    "punctuation": ("punctuation", "punctuation"),
    "whitespace": ("line breaks and spacing", "line break"),
    "suffix": ("word endings", "suffix"),
    "prefix": ("word-start pieces", "word start"),
    "inner": ("word-internal pieces", "word-internal piece"),
    "archaic pronoun": ("archaic 2nd-person pronouns", "archaic 2nd-person pronoun"),
    "archaic form": ("archaic verb forms", "archaic form"),
    "determiner": ("determiners", "determiner"),
    "preposition": ("prepositions", "preposition"),
    "conjunction": ("conjunctions", "conjunction"),
    "pronoun": ("pronouns", "pronoun"),
    "auxiliary verb": ("auxiliary verbs", "auxiliary verb"),
    "particle": ("particles and adverbs", "particle"),
    "boilerplate": ("web boilerplate", "boilerplate word"),
    "proper noun": ("names", "name"),
    "content": ("words", "word"),
}


def _word_span(text: str, start: int, end: int, inside: Callable[[str], bool]) -> tuple[int, int]:
    while start > 0 and inside(text[start - 1]):
        start -= 1
    while end < len(text) and inside(text[end]):
        end += 1
    return start, end


def _alnum(ch: str) -> bool:
    return ch.isalnum()


def _not_space(ch: str) -> bool:
    return not ch.isspace()


def token_kind(token: str, context: Sequence[str] | None = None, index: int = 0) -> TokenKind:
    """Classify one token, using its context (tokens around it) when given to see the word it is part of.

    Without a context (next tokens, logit signature) a token without a leading space that continues in lower case
    is taken as a word piece, which is what byte-level BPE tokens without a space are.
    """
    core = token.strip()
    if context is not None and 0 <= index < len(context):
        text = "".join(context)
        start = sum(len(t) for t in context[:index]) + (len(token) - len(token.lstrip()))
        end = start + len(core)
        chunk = text[slice(*_word_span(text, start, end, _not_space))]
        w_start, w_end = _word_span(text, start, end, _alnum)
        word = text[w_start:w_end] if core and core[0].isalnum() else core
        prev = context[index - 1] if index > 0 else ""
        is_piece = core.isalnum() and (w_start < start or w_end > end)
        piece = "suffix" if w_start < start and w_end == end else "prefix" if w_start == start else "inner"
        at_sentence_start = index == 0 or prev.rstrip(" ").endswith(_SENTENCE_END) or not prev.strip()
    else:
        chunk, word, prev = core, core, ""
        is_piece = core.isalpha() and not token[:1].isspace() and core[:1].islower() and len(core) <= 6
        piece = "suffix"
        at_sentence_start = True
    return TokenKind(*_classify(core, chunk, word, prev, is_piece, piece, at_sentence_start), core, word)


def _classify(core: str, chunk: str, word: str, prev: str, is_piece: bool, piece: str,
              at_sentence_start: bool) -> tuple[str | None, str]:
    """(category or None for a content word, kind) by the token rules, most specific first."""
    lower = core.lower()
    if not core:
        return "grammatical scaffolding", "whitespace"
    if _URL.search(chunk):
        return "urls", "url"
    if lower in _CURRENCY_WORDS or any(ch in _CURRENCY_SYMBOLS for ch in core):
        return "finance", "currency"
    if _NUMBER.fullmatch(word) or _NUMBER.fullmatch(core):
        number = word if _NUMBER.fullmatch(word) else core
        if any(ch in _CURRENCY_SYMBOLS for ch in prev):
            return "finance", "money"
        if _YEAR.fullmatch(number):
            kind = "year"
        elif re.fullmatch(r"\d{1,2}:\d\d", number):
            kind = "clock time"
        elif "%" in number:
            kind = "percentage"
        elif re.fullmatch(r"\d{1,4}[/-]\d{1,2}[/-]\d{1,4}", number):
            kind = "date"
        else:
            kind = "number"
        return "numbers/time", kind
    if not any(ch.isalnum() for ch in core):
        if core in _BOILERPLATE_WORDS:
            return "boilerplate", "boilerplate"
        return "grammatical scaffolding", "punctuation"
    if is_piece:
        return "morphology", piece
    if lower in _MONTHS and (lower not in _AMBIGUOUS_MONTHS or core[0].isupper()):
        return "numbers/time", "month"
    if lower in _WEEKDAYS:
        return "numbers/time", "weekday"
    if lower in _TIME_WORDS:
        return "numbers/time", "time word"
    if lower in _NUMBER_WORDS:
        return "numbers/time", "number word"
    if lower in _ARCHAIC_PRONOUNS:
        return "grammatical scaffolding", "archaic pronoun"
    if lower in _ARCHAIC_FORMS:
        return "grammatical scaffolding", "archaic form"
    for kind, words in _FUNCTION_WORDS.items():
        if lower in words:
            return "grammatical scaffolding", kind
    if lower in _BOILERPLATE_WORDS:
        return "boilerplate", "boilerplate"
    if core[0].isupper() and not at_sentence_start:
        return None, "proper noun"
    return None, "content"


# ----------------------------------------------------------------------------------------------------------------
# The offline labeler.

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


def _shares(kinds: list[TokenKind], weights: list[float]) -> Counter:
    total = sum(weights)
    shares: Counter = Counter()
    for k, w in zip(kinds, weights, strict=True):
        shares[k.category] += w / total if total else 0.0
    return shares


def _quote(token: str) -> str:
    return "'" + token.strip().replace("'", "’") + "'"


class OfflineLabeler:
    """Deterministic labels without a network: token rules first, sentence-embedding semantics for content words.

    1. Every evidence token is classified by rules (token_kind): URL, currency, number/date/time, punctuation,
       word piece (a token inside a longer word: morphology), archaic form, function word, boilerplate; anything
       else is a content word. Next tokens (weight NEXT_WEIGHT) and the logit signature (LOGIT_WEIGHT) are
       classified the same way and added, weighted, to the evidence's shares (function words and punctuation at
       half weight there: they follow, and are promoted after, almost any token).
    2. A rule category with a majority of the weight is the category. Otherwise, when content words weigh at
       least as much as the largest rule category, the evidence contexts and the list of evidence tokens are
       embedded and compared with written descriptions of each semantic category (CATEGORY_DESCRIPTIONS), minus
       each description's mean similarity to background contexts (`prepare`), so that a description close to
       everything does not win everywhere. A weak best match, or rule kinds without a majority, give 'misc'.
    3. The label is the dominant role's phrase plus the dominant tokens ("year numbers (1843, 1850)",
       "suffix -tion", "preposition 'of' after 'out'"), the explanation gives the shares behind it.
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
            promoted = ", ".join(_quote(t) for t, v in card.logit_tokens[:3] if v > 0)
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
        if rule is not None and rule_share >= RULE_MAJORITY:
            category = rule
        elif content_share > 0 and content_share >= rule_share:
            category, role, score, agreement = self._semantic(card, ev_kinds)
            semantic_note = f"; closest description: {role} ({score:+.3f}, {agreement:.0%} of the words agree)"
            if score < SEMANTIC_MIN or agreement < SEMANTIC_AGREEMENT:
                category, role = "misc", None
        else:  # no majority and mostly rule tokens of several kinds: a mixed prototype
            category = "misc"

        label = self._phrase(card, ev_kinds, next_kinds, category, role)
        parts = [f"{c or 'content words'} {s:.0%}" for c, s in combined.most_common(3)]
        top = ", ".join(f"{_quote(t)}×{n}" for t, n in card.activating_tokens[:4])
        explanation = f"token shares: {', '.join(parts)}{semantic_note}; top evidence tokens {top}"
        if card.next_tokens:
            explanation += "; followed by " + ", ".join(_quote(t) for t, _ in card.next_tokens[:3])
        if logit:
            explanation += "; promotes " + ", ".join(_quote(t) for t, _ in logit[:3])
        return LabelResult(category, label, explanation)

    def _semantic(self, card: PrototypeCard, kinds: list[TokenKind]) -> tuple[str, str, float, float]:
        """(category, role, calibrated score, agreement) of the best semantic role for the evidence's content words.

        Each content word is scored by its context window and by the word alone; the role's score is the mean of
        those and the similarity to the list of words; agreement is the share of words whose own best category
        is the winner's (a random mix of words scores something somewhere, but its words disagree).
        """
        pairs = [(e, k) for e, k in zip(card.evidence, kinds, strict=True) if k.category is None]
        pairs = pairs or list(zip(card.evidence, kinds, strict=True))
        words = [k.word or k.core for _, k in pairs]
        n = len(pairs)
        vectors = embed([e.window() for e, _ in pairs] + words + [", ".join(dict.fromkeys(words[:12]))])  # (2n+1, D)
        sims = vectors @ self._description_vectors().T - self._bias  # (2n + 1, R)
        items = 0.5 * sims[:n] + 0.5 * sims[n:2 * n]  # (n, R)
        names = np.array([c == "named entities" for c, _ in self._roles])  # (R,)
        proper = np.array([k.kind == "proper noun" for _, k in pairs])  # (n,)
        items = items + 0.05 * np.outer(proper, names)  # capitalised mid-sentence: a name more often than not
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
            label = f"mixed tokens ({', '.join(_quote(e) for e, _ in examples.most_common(3))})"
        elif kind in ("suffix", "inner", "prefix"):
            label = self._piece_phrase(kind, chosen)
        elif top_n / n >= 0.6:
            label = f"{_KIND_PHRASES[kind][1]} {_quote(top)}"
        else:
            label = f"{_KIND_PHRASES[kind][0]} ({', '.join(e for e, _ in examples.most_common(3))})"
        if kind in ("archaic pronoun",):  # the role is the label; the words go to the explanation
            label = _KIND_PHRASES[kind][1 if top_n / n >= 0.6 else 0]
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
        return f"{_KIND_PHRASES[kind][0]} ({', '.join(p for p, _ in pieces.most_common(3))})"

    @staticmethod
    def _qualifier(card: PrototypeCard, next_kinds: list[TokenKind], category: str) -> str:
        """'after X' when one preceding token dominates, else 'before Y' from the next-token distribution."""
        prev = Counter(e.previous_token.strip().lower() for e in card.evidence if e.previous_token.strip())
        if prev and len(card.evidence) >= 3:
            token, count = prev.most_common(1)[0]
            if count / len(card.evidence) >= 0.6:
                return f" after {_quote(token)}"
        total = sum(n for _, n in card.next_tokens)
        if total:
            token, count = card.next_tokens[0]
            if count / total >= 0.5 and token.strip():
                return f" before {_quote(token)}"
            weights = Counter()
            for (_, n), k in zip(card.next_tokens, next_kinds, strict=True):
                weights[k.kind if k.category not in (None, category) else None] += n
            kind, count = weights.most_common(1)[0]
            if kind is not None and count / total >= 0.6:
                return f" before {_KIND_PHRASES[kind][0]}"
        return ""


# ----------------------------------------------------------------------------------------------------------------
# LLM labelers: one prompt, one JSON answer, one retry.

SYSTEM_PROMPT = ("You label the prototypes of an interpretable language model. Answer with one JSON object and "
                 "nothing else.")


def build_prompt(card: PrototypeCard, n_evidence: int = 12) -> str:
    """The card as text for an instruct model, ending with the JSON it must answer."""
    lines = [
        "A prototype is a learned direction in the model's final hidden state. It activates on the tokens marked "
        "«like this» in the contexts below (highest activation first). Name its role.",
        "",
        f"Prototype {card.prototype_id}: active on {card.activation_count} tokens"
        + (f", mean activation {card.mean_activation:.3f}" if card.mean_activation is not None else "")
        + (f", max {card.max_activation:.3f}" if card.max_activation is not None else ""),
    ]
    if card.activating_tokens:
        lines.append("Activating tokens: " + ", ".join(f"{t!r} x{n}" for t, n in card.activating_tokens[:12]))
    lines.append("Evidence:")
    for i, e in enumerate(card.evidence[:n_evidence], 1):
        lines.append(f"{i}. (a={e.activation:.2f}) {e.marked()}")
    if not card.evidence:
        lines.append("(none: the prototype was never active)")
    if card.next_tokens:
        lines.append("Tokens that follow the evidence: " + ", ".join(f"{t!r} x{n}" for t, n in card.next_tokens[:10]))
    if card.logit_tokens:
        lines.append("Tokens it promotes (logit signature): "
                     + ", ".join(f"{t!r}" for t, _ in card.logit_tokens[:10]))
    lines += [
        "",
        "Categories (choose exactly one): " + ", ".join(CATEGORIES) + ".",
        "Answer with JSON only: {\"category\": \"<one of the categories>\", \"label\": \"<a few words naming the "
        "specific role, e.g. 'year numbers', 'suffix -tion', 'archaic 2nd-person pronoun'>\", "
        "\"explanation\": \"<one sentence>\"}",
    ]
    return "\n".join(lines)


def parse_reply(text: str) -> LabelResult:
    """A labeler's reply -> LabelResult. Tolerates code fences and text around the JSON object; an unknown
    category becomes 'misc' with a note. Raises ValueError when no usable object is found."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        try:
            obj, _ = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and "label" in obj and "category" in obj:
            break
    else:
        raise ValueError(f"no JSON object with 'category' and 'label' in the reply: {text[:200]!r}")
    label = " ".join(str(obj["label"]).split())[:MAX_LABEL_CHARS]
    if not label:
        raise ValueError(f"empty label in the reply: {text[:200]!r}")
    explanation = " ".join(str(obj.get("explanation") or "").split())
    category = normalize_category(str(obj["category"]))
    if category is None:
        explanation = f"(labeler said category {str(obj['category'])[:40]!r}, not in the taxonomy) {explanation}"
        category = "misc"
    return LabelResult(category, label, explanation.strip())


class _PromptLabeler:
    """Prompt -> completion -> parsed label, retrying once on a failed request or an unusable reply."""

    name = "prompt"

    def _complete(self, prompt: str) -> str:
        raise NotImplementedError

    def label(self, card: PrototypeCard) -> LabelResult:
        prompt = build_prompt(card)
        error: Exception | None = None
        for attempt in range(2):
            try:
                return parse_reply(self._complete(prompt))
            except (LabelerError, ValueError) as err:
                error = err
                logger.warning("%s, prototype %d, attempt %d: %s", self.name, card.prototype_id, attempt + 1, err)
        raise LabelerError(f"{self.name} failed twice on prototype {card.prototype_id}: {error}") from error


class OpenAICompatibleLabeler(_PromptLabeler):
    """POSTs the card to {base_url}/chat/completions (OpenAI chat format) with the standard library.

    base_url is the API root, e.g. http://127.0.0.1:8000/v1. The api_key, if any, is sent as a bearer token and is
    never stored in the database.
    """

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout: float = 60.0,
                 max_tokens: int = 300) -> None:
        parsed = urllib.parse.urlparse(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"endpoint must be an http(s) URL such as http://127.0.0.1:8000/v1, got {base_url!r}")
        self.base_url, self.model_id, self.timeout, self.max_tokens = base_url.rstrip("/"), model, timeout, max_tokens
        self._api_key = api_key
        self.name = f"openai:{model}@{self.base_url}"
        local = parsed.hostname in ("127.0.0.1", "localhost", "::1")
        handlers = [urllib.request.ProxyHandler({})] if local else []  # never send a local server through a proxy
        self._opener = urllib.request.build_opener(*handlers)

    def _complete(self, prompt: str) -> str:
        url = f"{self.base_url}/chat/completions"
        body = {"model": self.model_id, "temperature": 0, "max_tokens": self.max_tokens,
                "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]}
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
        try:
            with self._opener.open(request, timeout=self.timeout) as response:
                payload = json.loads(response.read().decode("utf-8", errors="replace"))
        except urllib.error.HTTPError as err:
            detail = err.read()[:300].decode("utf-8", errors="replace")
            raise LabelerError(f"{url} answered HTTP {err.code} {err.reason}: {detail}") from err
        except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
            raise LabelerError(f"cannot reach {url}: {getattr(err, 'reason', err)}") from err
        except json.JSONDecodeError as err:
            raise LabelerError(f"{url} did not answer JSON: {err}") from err
        try:
            return str(payload["choices"][0]["message"]["content"])
        except (KeyError, IndexError, TypeError) as err:
            raise LabelerError(f"{url} answered no chat completion: {str(payload)[:200]}") from err


class LocalInstructLabeler(_PromptLabeler):
    """A transformers causal LM in a local folder (its chat template if it has one), greedy decoding.

    Loads with local_files_only=True: a path that is not a local model folder is an error, never a download.
    """

    def __init__(self, model_path: str | Path, max_new_tokens: int = 160, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a local transformers model folder (no config.json); "
                                    "LocalInstructLabeler never downloads")
        self.model_id, self.max_new_tokens, self.device = str(path), max_new_tokens, device
        self.name = f"local:{path.resolve().name}"
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).to(device).eval()

    def _complete(self, prompt: str) -> str:
        import torch

        if getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]
            encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                         return_dict=True, return_tensors="pt")
            ids = encoded["input_ids"]
        else:
            ids = self.tokenizer(f"{SYSTEM_PROMPT}\n\n{prompt}\nJSON:", return_tensors="pt").input_ids
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if limit and ids.shape[1] + self.max_new_tokens > limit:  # keep the end: it holds the answer format
            logger.warning("prompt of %d tokens cut to fit the model's %d positions", ids.shape[1], limit)
            ids = ids[:, -(limit - self.max_new_tokens):]
        ids = ids.to(self.device)  # (1, T)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.max_new_tokens,
                                      do_sample=False, pad_token_id=pad)  # (1, T + new)
        return self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


# ----------------------------------------------------------------------------------------------------------------
# Scoring: does the label pick out held-out evidence?


def auroc(positives: np.ndarray, negatives: np.ndarray) -> float:
    """Area under the ROC curve from ranks (Mann-Whitney U; ties get the average rank). (P,), (N,) -> [0, 1]."""
    pos, neg = np.asarray(positives, dtype=np.float64), np.asarray(negatives, dtype=np.float64)
    if not len(pos) or not len(neg):
        raise ValueError("AUROC needs at least one positive and one negative")
    scores = np.concatenate([pos, neg])  # (P + N,)
    values, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)  # 1-based rank of the last member of each tie group
    average_rank = ends - (counts - 1) / 2.0  # (U,)
    ranks = average_rank[inverse]  # (P + N,)
    u = ranks[:len(pos)].sum() - len(pos) * (len(pos) + 1) / 2.0
    return float(u / (len(pos) * len(neg)))


@dataclass
class NegativePool:
    """A seeded sample of evidence contexts from all prototypes, embedded once per run."""

    prototype_ids: np.ndarray  # (N,) whose evidence each context is
    vectors: np.ndarray  # (N, D)
    ranks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # (N,) their evidence ranks


def negative_pool(con: duckdb.DuckDBPyConnection, n: int = N_NEGATIVES, seed: int = 0) -> NegativePool:
    """Sample n evidence rows uniformly (seeded) over the whole evidence table and embed their contexts."""
    total = con.execute("SELECT count(*) FROM evidence").fetchone()[0]
    picks = np.sort(np.random.default_rng(seed).choice(total, size=min(n, total), replace=False)) if total else []
    rows = con.execute(
        f"SELECT {_EVIDENCE_COLUMNS} FROM (SELECT *, row_number() OVER (ORDER BY prototype_id, rank) - 1 AS i "
        "FROM evidence) e LEFT JOIN documents d USING (doc_id) WHERE list_contains(?, e.i) ORDER BY e.i",
        [[int(i) for i in picks]]).fetchall()
    pairs = [(row[0], context) for row in rows if (context := _evidence(*row[1:])) is not None]
    vectors = embed([c.window() for _, c in pairs]) if pairs else np.zeros((0, EMBED_DIM), np.float32)  # (N, D)
    return NegativePool(prototype_ids=np.array([pid for pid, _ in pairs], dtype=np.int64), vectors=vectors,
                        ranks=np.array([c.rank for _, c in pairs], dtype=np.int64))


def score_labels(items: list[tuple[int, str, list[EvidenceContext]]], pool: NegativePool) -> list[float | None]:
    """label_score for each (prototype_id, label, held-out evidence): AUROC of cos(label, context) separating the
    held-out contexts from the pool's contexts of other prototypes. None when either side is empty."""
    texts = [label for _, label, _ in items] + [e.window() for _, _, held in items for e in held]
    vectors = embed(texts)  # (L + H, D)
    labels, contexts = vectors[:len(items)], vectors[len(items):]
    scores, offset = [], 0
    for (pid, _, held), label in zip(items, labels, strict=True):
        positives = contexts[offset:offset + len(held)] @ label  # (h,)
        offset += len(held)
        others = pool.vectors[pool.prototype_ids != pid] if len(pool.prototype_ids) else pool.vectors[:0]
        scores.append(auroc(positives, others @ label) if len(held) and len(others) else None)
    return scores


# ----------------------------------------------------------------------------------------------------------------
# The job.


def label_prototypes(cards: list[PrototypeCard], labeler: Labeler, pool: NegativePool,
                     context=None) -> list[tuple]:
    """Rows of `labels` for the cards: label the even-ranked evidence, score on the odd-ranked. With a
    precompute.contrast.ContrastContext the rows also carry sibling_score (columns: LABEL_COLUMNS)."""
    results, items = [], []
    for card in cards:
        train, held_out = card.split()
        result = labeler.label(train)
        if result.category not in CATEGORIES:  # a custom labeler's slip: keep the row, mark it
            result = LabelResult("misc", result.label, f"(category {result.category!r} not in the taxonomy) "
                                 f"{result.explanation}")
        results.append(result)
        items.append((card.prototype_id, result.label, held_out))
    if context is None:
        scores = [(s, None) for s in score_labels(items, pool)]
    else:
        from precompute import contrast

        scores = contrast.score_labels(context, pool, [(pid, label) for pid, label, _ in items])
    return [(card.prototype_id, r.category, r.label, s, labeler.name, r.explanation, sib)
            for card, r, (s, sib) in zip(cards, results, scores, strict=True)]


LABEL_COLUMNS = ("prototype_id", "category", "label", "label_score", "labeler", "explanation", "sibling_score")


def run(con: duckdb.DuckDBPyConnection, labeler: Labeler | None = None, overwrite: bool = False,
        batch_size: int = 64, seed: int = 0, n_negatives: int = N_NEGATIVES) -> int:
    """Label every prototype of prototype_stats; returns the number of rows written by this call.

    Every labeler's rows get both held-out scores (label_score, sibling_score; precompute/contrast.py) and the
    prototype's siblings go into label_siblings. Resumable (see the module docstring); 'done' with the same
    arguments writes nothing; other arguments raise JobArgsMismatch unless overwrite. batch_size is the number of
    prototypes per transaction and not part of the job's arguments (the rows do not depend on it).
    """
    # contrast imports this module (cards, token rules, v1): imported here, not at the top, to keep one direction
    from precompute import contrast

    labeler = labeler or contrast.ContrastiveLabeler()
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not job_done(con, "evidence"):
        raise RuntimeError("the evidence job has not finished in this database: run it first")
    args = {"labeler": labeler.name, "labeler_model": getattr(labeler, "model_id", None), "embed_model": EMBED_MODEL,
            "seed": seed, "n_negatives": n_negatives, "window": [WINDOW_BEFORE, WINDOW_AFTER],
            "evidence_run": job_run_id(con, "evidence"),
            "siblings": {"n": contrast.N_SIBLINGS, "min_overlap": contrast.MIN_OVERLAP, "n_select": contrast.N_SELECT}}
    state = start_job(con, JOB, args, overwrite)
    if state == "done":
        logger.info("labels: already done with these arguments")
        return 0
    todo = remaining_prototypes(con, JOB)
    logger.info("labels: %s run, %d prototypes to label with %s", state, len(todo), labeler.name)
    pool = negative_pool(con, n_negatives, seed)
    if hasattr(labeler, "prepare"):
        labeler.prepare(pool.vectors)
    context = contrast.build_context(con, pool, seed)
    if hasattr(labeler, "prepare_contrast"):
        labeler.prepare_contrast(context)
    written = 0
    insert = f"INSERT INTO labels ({', '.join(LABEL_COLUMNS)}) VALUES ({', '.join('?' * len(LABEL_COLUMNS))})"
    with tqdm(total=len(todo), desc="labels", unit="prototype") as bar:
        for start in range(0, len(todo), batch_size):
            chunk = todo[start:start + batch_size]
            rows = label_prototypes(load_cards(con, chunk), labeler, pool, context)
            siblings = [row for pid in chunk for row in contrast.separations(context, pid)]

            def write(rows=rows, siblings=siblings, chunk=chunk) -> None:
                con.execute("DELETE FROM labels WHERE prototype_id BETWEEN ? AND ?", [chunk[0], chunk[-1]])
                con.execute("DELETE FROM label_siblings WHERE prototype_id BETWEEN ? AND ?", [chunk[0], chunk[-1]])
                con.executemany(insert, rows)
                if siblings:
                    con.executemany("INSERT INTO label_siblings VALUES (?, ?, ?, ?, ?)", siblings)

            write_chunk(con, JOB, write, str(chunk[-1]))
            written += len(rows)
            bar.update(len(chunk))
            logger.info("labels: committed prototypes %d-%d (%d/%d)", chunk[0], chunk[-1], start + len(chunk),
                        len(todo))
    finish_job(con, JOB)
    return written


def make_labeler(kind: str, endpoint: str | None = None, model: str | None = None, api_key: str | None = None,
                 timeout: float = 60.0) -> Labeler:
    """The labeler the command line names: offline (v2, contrastive) | offline-v1 | openai (endpoint + model) |
    local (model folder)."""
    if kind == "offline":
        from precompute.contrast import ContrastiveLabeler

        return ContrastiveLabeler()
    if kind == "offline-v1":
        return OfflineLabeler()
    if kind == "openai":
        if not endpoint or not model:
            raise ValueError("--labeler openai needs --endpoint URL and --llm-model NAME")
        return OpenAICompatibleLabeler(endpoint, model, api_key=api_key, timeout=timeout)
    if kind == "local":
        if not model:
            raise ValueError("--labeler local needs --llm-model FOLDER (a local transformers model)")
        return LocalInstructLabeler(model)
    raise ValueError(f"unknown labeler {kind!r}: offline, offline-v1, openai or local")


def category_mix(con: duckdb.DuckDBPyConnection) -> list[tuple[str, int, float]]:
    """(category, prototypes, mean label_score, mean sibling_score) from the labels table, largest first."""
    return con.execute("SELECT category, count(*) AS n, avg(label_score), avg(sibling_score) FROM labels "
                       "GROUP BY category ORDER BY n DESC, category").fetchall()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m precompute.labels", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--db", required=True, help="the precompute DuckDB file (with the evidence job done)")
    # which labeler
    parser.add_argument("--labeler", choices=("offline", "offline-v1", "openai", "local"), default="offline",
                        help="offline: v2, contrastive to the siblings (precompute/contrast.py); offline-v1: token "
                             "rules only")
    parser.add_argument("--endpoint", help="openai: the API root, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--llm-model", help="openai: the model name; local: the model folder")
    parser.add_argument("--api-key-env", default="OPENAI_API_KEY",
                        help="openai: environment variable holding the API key (the key is never stored)")
    parser.add_argument("--timeout", type=float, default=60.0, help="openai: seconds per request")
    # the job
    parser.add_argument("--seed", type=int, default=0, help="seed of the negative contexts for label_score")
    parser.add_argument("--n-negatives", type=int, default=N_NEGATIVES, help="random contexts scored against")
    parser.add_argument("--batch-size", type=int, default=64, help="prototypes per transaction")
    parser.add_argument("--overwrite", action="store_true", help="replace labels made with other arguments")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not Path(args.db).is_file():
        parser.error(f"no database at {args.db}: run the evidence job first (python -m precompute build)")
    try:
        labeler = make_labeler(args.labeler, args.endpoint, args.llm_model, os.environ.get(args.api_key_env),
                               args.timeout)
        con = connect(args.db)
        try:
            written = run(con, labeler, overwrite=args.overwrite, batch_size=args.batch_size, seed=args.seed,
                          n_negatives=args.n_negatives)
            mix = category_mix(con)
        finally:
            con.close()
    except (JobArgsMismatch, LabelerError, RuntimeError, ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    total = sum(n for _, n, _, _ in mix)
    print(f"labels: wrote {written} rows; {total} prototypes labelled")  # noqa: T201 - the command's output
    for category, n, score, sibling in mix:
        mean = f"{score:.3f}" if score is not None else "-"
        sib = f"{sibling:.3f}" if sibling is not None else "-"
        print(f"  {category:<24} {n:>6} {n / total:6.1%}  mean label_score {mean}  "  # noqa: T201
              f"sibling_score {sib}")
    return written


if __name__ == "__main__":
    main()
