"""The labels job as a package: a broad category, a topic, a two-sided label and held-out scores for every prototype.

Each prototype gets a category from the paper's taxonomy (schema.CATEGORIES: morphology, grammatical scaffolding,
medical/bio, ...) and a label naming its specific role ("archaic 2nd-person pronoun", "year numbers", "suffix
-tion"); docs/DESIGN.md section 6 says why. One row per prototype of prototype_stats goes into `labels`:

    category      one of schema.CATEGORIES
    label         a few words naming the specific role; labeler v3 writes "fires_on → pushes"
    fires_on      where it fires (v3): the tokens, the words around them, the source
    pushes        what it pushes the next token toward (v3): next tokens its evidence shows and W p_i raises
    topic         the specific topic under the category, "religion - scripture" (v3; twosided.TOPICS)
    detection_random, detection_sibling
                  held-out detection balanced accuracy (detection.py): given the label, tell the prototype's
                  held-out contexts from random ones / from its siblings', threshold fitted on the visible ones
    label_score   AUROC of cos(label embedding, context embedding) separating the prototype's HELD-OUT evidence
                  contexts (odd ranks; the label is made from the even ranks only) from a seeded sample of other
                  prototypes' contexts: 0.5 = the label says nothing about the evidence, 1.0 = it singles it out
    sibling_score AUROC of the same similarity separating the held-out evidence from the held-out evidence of the
                  prototype's siblings only (prototypes whose evidence shares its tokens; contrast.py): does the
                  label single it out among prototypes on the same tokens? NULL without siblings
    labeler       which labeler wrote it; explanation: why, in one or two sentences

The siblings themselves, with a short "what separates them", go into `label_siblings`.

One module per responsibility:
    cards.py     what a labeler sees: a prototype's evidence contexts, next tokens and logit signature
    labeler.py   the labeler interface (`name`, `label(card) -> LabelResult`) and the category names
    tokens.py    token rules: closed classes of tokens that need no semantics
    offline.py   labeler v1 ('offline-v1'): token rules + sentence-embedding similarity to category descriptions
    contrast.py  labeler v2 ('offline-v2'): what sets a prototype apart from its siblings; sibling scores
    twosided.py  labeler v3 ('offline', the default): where it fires and what it pushes, with a topic
    detection.py detection scores: the marked scorer (a label's claims checked on a context), the intruder check
    llm.py       OpenAICompatibleLabeler (any /chat/completions endpoint), LocalInstructLabeler (a local folder)
    scoring.py   label_score: AUROC on held-out evidence against other prototypes' contexts
    job.py       the job: resumable, chunked, arguments stored
    __main__.py  its command line:

    python -m precompute.labels --db out.duckdb
    python -m precompute.labels --db out.duckdb --labeler openai --endpoint http://127.0.0.1:8000/v1 --llm-model qwen

What other code uses is importable from the package itself (`from precompute.labels import run, load_cards`).
"""

from precompute.labels.cards import (
    WINDOW_AFTER,
    WINDOW_BEFORE,
    EvidenceContext,
    PrototypeCard,
    clean_token,
    context_pieces,
    load_cards,
)
from precompute.labels.contrast import ContrastiveLabeler
from precompute.labels.job import (
    JOB,
    LABEL_COLUMNS,
    LABELERS,
    LabelsArgs,
    category_mix,
    label_prototypes,
    make_labeler,
    run,
)
from precompute.labels.labeler import MAX_LABEL_CHARS, Labeler, LabelerError, LabelResult, normalize_category
from precompute.labels.llm import LocalInstructLabeler, OpenAICompatibleLabeler, build_prompt, parse_reply
from precompute.labels.offline import OfflineLabeler
from precompute.labels.scoring import N_NEGATIVES, NegativePool, auroc, negative_pool, score_labels
from precompute.labels.tokens import TokenKind, token_kind

__all__ = ["JOB", "LABELERS", "LABEL_COLUMNS", "MAX_LABEL_CHARS", "N_NEGATIVES", "WINDOW_AFTER", "WINDOW_BEFORE",
           "LabelsArgs", "ContrastiveLabeler", "EvidenceContext", "LabelResult", "Labeler", "LabelerError",
           "LocalInstructLabeler", "NegativePool", "OfflineLabeler", "OpenAICompatibleLabeler",
           "PrototypeCard", "TokenKind", "auroc", "build_prompt", "category_mix", "clean_token",
           "context_pieces", "label_prototypes", "load_cards", "make_labeler", "negative_pool",
           "normalize_category", "parse_reply", "run", "score_labels", "token_kind"]
