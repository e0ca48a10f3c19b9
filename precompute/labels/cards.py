"""Prototype cards: what a labeler knows about one prototype, read from the evidence job's tables.

    cards = load_cards(con, [0, 1, 2])           # in the given order
    card.evidence[0].window()                    # the context around the top evidence token (what gets embedded)
    card.evidence[0].marked()                    # the same with the token in «guillemets» (what an LLM reads)
    train, held_out = card.split()               # even ranks to label from, odd ranks to score the label on

Contexts are rebuilt from the document text (a pointer-only database reads it back from the installed corpus,
checked against its sha256) rather than from stored token strings, so a context reads as the document does.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import duckdb
import numpy as np

logger = logging.getLogger("precompute.labels")

WINDOW_BEFORE = 16  # context tokens before the evidence token in an embedded context (activation depends on these)
WINDOW_AFTER = 2  # and after it (what the prototype helps predict)


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
    for row in con.execute(f"SELECT {EVIDENCE_COLUMNS} {EVIDENCE_FROM} WHERE e.prototype_id BETWEEN ? AND ? "
                           "ORDER BY e.prototype_id, e.rank", [lo, hi]).fetchall():
        if row[0] in wanted:
            context = evidence_context(*row[1:])
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
EVIDENCE_COLUMNS = """e.prototype_id, e.rank, e.doc_id, e.token_position, e.context_start, e.activation, e.token,
    e.context_tokens, e.context_activations, e.context_char_starts, e.context_char_ends, d.sha256,
    greatest(coalesce(list_min(e.context_char_starts), e.char_start) - 1, 0) AS text_offset,
    substr(d.text, greatest(coalesce(list_min(e.context_char_starts), e.char_start) - 1, 0) + 1,
           coalesce(list_max(e.context_char_ends), e.char_end)
           - greatest(coalesce(list_min(e.context_char_starts), e.char_start) - 1, 0)) AS text"""
EVIDENCE_FROM = "FROM evidence e LEFT JOIN documents d USING (doc_id)"


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
        from prism.corpora import check_text

        return check_text(doc_id, sha256)
    except (ImportError, KeyError, ValueError, OSError) as err:
        logger.warning("no text for document %r: %s", doc_id, err)
        return None


def evidence_context(rank, doc_id, position, start, activation, token, tokens, acts, starts, ends, sha256, text_offset,
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
