"""The labeler interface every labeler follows, and what a label is.

    class MyLabeler:
        name = "mine"                                  # stored in labels.labeler and in the job's arguments
        def label(self, card: PrototypeCard) -> LabelResult: ...

A labeler may also have prepare(background_vectors) (called once with the embedded negative contexts) and
prepare_contrast(context) (called once with the siblings' context, precompute/labels/contrast.py). The labelers:
TwoSidedLabeler (twosided.py, the default 'offline'), ContrastiveLabeler (contrast.py, 'offline-v2'),
OfflineLabeler (offline.py, 'offline-v1'),
OpenAICompatibleLabeler and LocalInstructLabeler (llm.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from precompute.labels.cards import PrototypeCard
from precompute.schema import CATEGORIES

MAX_LABEL_CHARS = 80


class LabelerError(RuntimeError):
    """A labeler could not produce a label (endpoint down, HTTP error, unusable replies after a retry)."""


@dataclass(frozen=True)
class LabelResult:
    category: str  # one of CATEGORIES
    label: str  # a few words
    explanation: str = ""
    fires_on: str | None = None  # where it fires (labeler v3; None from labelers that do not say)
    pushes: str | None = None  # what it pushes the next token toward
    topic: str | None = None  # the specific topic under the category, e.g. "religion - scripture"


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
