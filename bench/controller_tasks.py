"""The controller experiment's data (bench/controllers.py): multiple-choice tasks built from held-out documents, and a
labelled report of what fitted controllers moved.

    python -m bench.controller_tasks build --checkpoint runs/prism/final --out runs/prism/tasks
    python -m bench.controller_tasks build --corpus default --val-fraction 0.05 --out tasks/ --stats
    python -m bench.controller_tasks describe --controllers runs/prism/ctl --db out.duckdb

It lives beside the benchmarks, not among the precompute jobs: it writes evaluation items as JSONL files for the
experiment (nothing the app reads, no database table), and describe reports on the experiment's fitted controllers.

Which documents: only those the model never trained on, i.e. prism.data.is_validation(doc_id, val_fraction) with
the training run's corpus and val_fraction (read from train_args.json beside --checkpoint). Those documents are
split again, by document, into fit / val / test: per source, documents are ordered by sha256("controller-split/" +
doc_id) and dealt out in the repeating pattern SPLIT_PATTERN (5 fit : 2 val : 3 test, every source in every split
once it has 3 documents). Distractors come only from other documents of the same source and the same split, so no
text of a test document appears in a fit or val item, as a right answer or as a distractor.

Units: a KJV chapter is one section of verses (one per line); Wikipedia and news text is cut into sections at
headings (a line of at most 12 words without closing punctuation) and the lines of a section into sentences with
a deterministic rule (a boundary is . ! or ? plus optional closing quotes/brackets, whitespace, then a capital
letter, digit or opening quote, unless the word before is a known abbreviation or a single capital letter).

Tasks (4 options each, the right one at a position drawn per item; every draw is seeded by sha256 of the task,
document and unit, so building twice gives the same file):
- next_sentence: the context is up to 3 preceding units of the same section; the options are the true next unit
  and 3 units (4-40 words, length within x0.5-x2 of the answer when possible) from other documents; every option
  starts with the separator that precedes the true unit (a space, or a newline for verses).
- cloze: one gap per unit, a number (digits, matched by shape: 1975 against other 4-digit numbers; or a number
  word) or a name (a capitalised word that is not the unit's first word and whose lower-case form never occurs in
  that source's held-out text). The context is up to 2 preceding units plus the unit up to the gap; an option is
  the filler followed by the same next (at most) 8 words of the unit. Distractors are fillers of the same kind
  and shape from other documents that occur nowhere in the item's own document.
At most --max-per-doc items per document and task (default 48; which positions, drawn by the seeded generator).
Counts on the offline default corpus at val_fraction 0.05 (73 held-out documents: 8 wiki, 20 news, 45 KJV):
next_sentence 1388 items (fit 701 / val 308 / test 379), cloze 1094 (fit 589 / val 224 / test 281).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from prism import cli
from prism.controller_fit import SPLITS, MCItem, write_items
from prism.corpora import iter_documents
from prism.data import Document, is_validation

logger = logging.getLogger(__name__)

TASKS = ("next_sentence", "cloze")
SPLIT_PATTERN = ("fit", "val", "test", "fit", "test", "fit", "val", "test", "fit", "fit")  # 5 : 2 : 3
N_OPTIONS = 4
MIN_WORDS, MAX_WORDS = 4, 40  # a next_sentence option
NEXT_CONTEXT_UNITS, CLOZE_CONTEXT_UNITS = 3, 2
CLOZE_SUFFIX_WORDS = 8
MAX_HEADING_WORDS = 12
ABBREVIATIONS = frozenset("""mr mrs ms dr st mt jr sr vs etc e.g i.e no nos inc ltd co corp gen col lt sgt capt prof
rev fig figs approx ca c cf al jan feb mar apr jun jul aug sep sept oct nov dec u.s u.k u.n a.d b.c b.c.e c.e ph.d
op vol pp ed eds est dept univ""".split())
NUMBER_WORDS = frozenset("""one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen
sixteen seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety hundred thousand million
billion""".split())
_BOUNDARY = re.compile(r"[.!?][\"'”’)\]]*\s+(?=[\"'“‘(\[]?[A-Z0-9])")
_LAST_WORD = re.compile(r"(\S+)$")
_NUMBER = re.compile(r"(?<![\w.,])\d+(?:,\d{3})*(?:\.\d+)?(?![\w]|[.,]\d)")
_WORD = re.compile(r"[A-Za-z]+")
_SUFFIX = re.compile(r"\S*(?:\s+\S+){0," + str(CLOZE_SUFFIX_WORDS - 1) + "}")  # up to 8 pieces
_NAME = re.compile(r"(?<![\w'’-])[A-Z][a-z]{2,}(?![\w'’-])")


# ----------------------------------------------------------------------------------------------------------------
# Units: sections of sentences (or verses).


@dataclass(frozen=True)
class Unit:
    text: str
    sep: str  # what precedes the unit in the document: " ", "\n" (verses, paragraphs)


def split_sentences(text: str) -> list[str]:
    """Sentences of one line of prose (module docstring's rule)."""
    out, start = [], 0
    for match in _BOUNDARY.finditer(text):
        before = _LAST_WORD.search(text[start: match.start() + 1])
        word = before.group(1).rstrip(".!?").lstrip("\"'“‘([") if before else ""
        if match.group(0)[0] == "." and (word.lower() in ABBREVIATIONS or re.fullmatch(r"[A-Z]", word)):
            continue
        end = match.end()
        out.append(text[start:end].strip())
        start = end
    tail = text[start:].strip()
    if tail:
        out.append(tail)
    return [s for s in out if s]


def _is_heading(line: str) -> bool:
    return len(line.split()) <= MAX_HEADING_WORDS and not re.search(r"[.!?:;\"'”’)]$", line)


def sections(doc: Document) -> list[list[Unit]]:
    """The document as sections of units: verses for KJV, sentences otherwise."""
    if doc.source == "kjv":
        return [[Unit(line.strip(), "\n") for line in doc.text.split("\n") if line.strip()]]
    out: list[list[Unit]] = []
    current: list[Unit] = []
    for line in doc.text.split("\n"):
        line = line.strip()
        if not line:
            continue
        if _is_heading(line):
            if current:
                out.append(current)
            current = []
            continue
        for n, sentence in enumerate(split_sentences(line)):
            current.append(Unit(sentence, "\n" if n == 0 and current else " "))
    if current:
        out.append(current)
    return out


def _join(units: list[Unit]) -> str:
    return "".join((u.sep if n else "") + u.text for n, u in enumerate(units))


def _rng(*parts: object) -> random.Random:
    return random.Random(int(hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:16], 16))


def _n_words(text: str) -> int:
    return len(text.split())


# ----------------------------------------------------------------------------------------------------------------
# Documents and splits.


def held_out(docs: Iterable[Document], val_fraction: float) -> list[Document]:
    """The documents a model trained with this val_fraction never saw (prism.data.is_validation)."""
    return [d for d in docs if is_validation(d.doc_id, val_fraction)]


def assign_splits(docs: Iterable[Document]) -> dict[str, str]:
    """{doc_id: fit | val | test}, per source by the hash order and SPLIT_PATTERN (module docstring)."""
    by_source: dict[str, list[str]] = defaultdict(list)
    for d in docs:
        by_source[d.source].append(d.doc_id)
    out = {}
    for ids in by_source.values():
        ordered = sorted(ids, key=lambda i: hashlib.sha256(f"controller-split/{i}".encode()).hexdigest())
        for n, doc_id in enumerate(ordered):
            out[doc_id] = SPLIT_PATTERN[n % len(SPLIT_PATTERN)]
    return out


def _pick(rng: random.Random, positions: list, limit: int) -> list:
    if len(positions) <= limit:
        return positions
    return sorted(rng.sample(positions, limit))


def _options(rng: random.Random, answer: str, distractors: list[str]) -> tuple[list[str], int]:
    options = list(distractors)
    at = rng.randrange(len(options) + 1)
    options.insert(at, answer)
    return options, at


# ----------------------------------------------------------------------------------------------------------------
# next_sentence


def build_next_sentence(docs: list[Document], splits: dict[str, str], max_per_doc: int = 48) -> list[MCItem]:
    units = {d.doc_id: sections(d) for d in docs}
    pool: dict[tuple[str, str], list[tuple[str, str]]] = defaultdict(list)  # (source, split) -> (doc_id, text)
    for d in docs:
        for section in units[d.doc_id]:
            for u in section:
                if MIN_WORDS <= _n_words(u.text) <= MAX_WORDS:
                    pool[d.source, splits[d.doc_id]].append((d.doc_id, u.text))
    items = []
    for d in docs:
        split = splits[d.doc_id]
        eligible = [(s, i) for s, section in enumerate(units[d.doc_id]) for i in range(1, len(section))
                    if MIN_WORDS <= _n_words(section[i].text) <= MAX_WORDS]
        for s, i in _pick(_rng("next_sentence", d.doc_id), eligible, max_per_doc):
            section = units[d.doc_id][s]
            answer = section[i]
            rng = _rng("next_sentence", d.doc_id, s, i)
            others = sorted({(doc_id, t) for doc_id, t in pool[d.source, split]
                             if doc_id != d.doc_id and t != answer.text})
            n = _n_words(answer.text)
            similar = [o for o in others if n / 2 <= _n_words(o[1]) <= 2 * n]
            candidates = similar if len(similar) >= N_OPTIONS - 1 else others
            if len(candidates) < N_OPTIONS - 1:
                continue
            chosen = rng.sample(candidates, N_OPTIONS - 1)
            options, at = _options(rng, answer.sep + answer.text, [answer.sep + t for _, t in chosen])
            items.append(MCItem(
                item_id=f"next_sentence/{d.doc_id}/{s}/{i}", task="next_sentence", doc_id=d.doc_id, source=d.source,
                split=split, context=_join(section[max(0, i - NEXT_CONTEXT_UNITS): i]), options=tuple(options),
                answer=at, meta={"option_docs": [doc_id for doc_id, _ in chosen]}))
    return items


# ----------------------------------------------------------------------------------------------------------------
# cloze


@dataclass(frozen=True)
class Gap:
    start: int
    end: int
    filler: str
    kind: str  # number | name
    shape: str  # digits as 9 ("1975" -> "9999"), "word" for number words, "name"


def _lowercase_words(docs: Iterable[Document]) -> set[str]:
    return {w for d in docs for w in _WORD.findall(d.text) if w.islower()}


def find_gaps(text: str, lowercase: set[str]) -> list[Gap]:
    """Candidate gaps of one unit, never in its first word, in text order."""
    words = text.split()
    first_end = len(text) - len(text.lstrip()) + (len(words[0]) if words else 0)
    gaps = [Gap(m.start(), m.end(), m.group(0), "number", re.sub(r"\d", "9", m.group(0)))
            for m in _NUMBER.finditer(text)]
    gaps += [Gap(m.start(), m.end(), m.group(0), "number", "word") for m in _WORD.finditer(text)
             if m.group(0) in NUMBER_WORDS]
    gaps += [Gap(m.start(), m.end(), m.group(0), "name", "name") for m in _NAME.finditer(text)
             if m.group(0).lower() not in lowercase]
    return sorted((g for g in gaps if g.start >= first_end), key=lambda g: g.start)


def _suffix(rest: str) -> str:
    """The text after a gap up to its CLOZE_SUFFIX_WORDS-th whitespace-separated piece."""
    return _SUFFIX.match(rest).group(0)


def _distractors(pool: dict, key: tuple[str, str, str], shapes: list[str], doc_id: str,
                 here: set[str]) -> dict[str, str]:
    """{filler: the document it comes from} for fillers of the given shapes from other documents, none of which
    occurs in the item's own document."""
    found: dict[str, str] = {}
    for shape in shapes:
        for other, filler in sorted(pool[(*key, shape)]):
            if other != doc_id and filler not in here:
                found.setdefault(filler, other)
    return found


def build_cloze(docs: list[Document], splits: dict[str, str], max_per_doc: int = 48) -> list[MCItem]:
    units = {d.doc_id: sections(d) for d in docs}
    lowercase = {src: _lowercase_words(d for d in docs if d.source == src) for src in {d.source for d in docs}}
    gaps = {(d.doc_id, s, i): find_gaps(u.text, lowercase[d.source])
            for d in docs for s, section in enumerate(units[d.doc_id]) for i, u in enumerate(section)}
    # (source, split, kind, shape) -> {(doc_id, filler)}: where distractors come from
    pool: dict[tuple[str, str, str, str], set[tuple[str, str]]] = defaultdict(set)
    source_of = {d.doc_id: d.source for d in docs}
    for (doc_id, _, _), found in gaps.items():
        for g in found:
            pool[source_of[doc_id], splits[doc_id], g.kind, g.shape].add((doc_id, g.filler))
    items = []
    for d in docs:
        split = splits[d.doc_id]
        here = set(_WORD.findall(d.text)) | set(_NUMBER.findall(d.text))  # never a distractor for this document
        eligible = [(s, i) for s, section in enumerate(units[d.doc_id]) for i in range(len(section))
                    if gaps[d.doc_id, s, i]]
        for s, i in _pick(_rng("cloze", d.doc_id), eligible, max_per_doc):
            section, rng = units[d.doc_id][s], _rng("cloze", d.doc_id, s, i)
            unit = section[i]
            gap = rng.choice(gaps[d.doc_id, s, i])
            before = unit.text[: gap.start]
            context = _join(section[max(0, i - CLOZE_CONTEXT_UNITS): i] + [Unit(before.rstrip(), unit.sep)])
            if _n_words(context) < 5:
                continue
            sep, suffix = before[len(before.rstrip()):], _suffix(unit.text[gap.end:])
            key = (d.source, split, gap.kind)
            found = _distractors(pool, key, [gap.shape], d.doc_id, here)
            if len(found) < N_OPTIONS - 1 and gap.kind == "number":  # too few of the same shape: any number
                found = _distractors(pool, key, sorted({k[3] for k in pool if k[:3] == key}), d.doc_id, here)
            if len(found) < N_OPTIONS - 1:
                continue
            chosen = rng.sample(sorted(found), N_OPTIONS - 1)
            options, at = _options(rng, sep + gap.filler + suffix, [sep + f + suffix for f in chosen])
            items.append(MCItem(
                item_id=f"cloze/{d.doc_id}/{s}/{i}", task="cloze", doc_id=d.doc_id, source=d.source, split=split,
                context=context, options=tuple(options), answer=at,
                meta={"gap": gap.kind, "shape": gap.shape, "filler": gap.filler,
                      "option_docs": [found[f] for f in chosen]}))
    return items


BUILDERS = {"next_sentence": build_next_sentence, "cloze": build_cloze}


def build_tasks(docs: Iterable[Document], val_fraction: float, max_per_doc: int = 48,
                tasks: Iterable[str] = TASKS) -> dict[str, list[MCItem]]:
    """{task: items} from the held-out documents of docs (module docstring)."""
    kept = held_out(docs, val_fraction)
    if not kept:
        raise ValueError(f"no held-out documents at val_fraction {val_fraction}: nothing to build tasks from")
    splits = assign_splits(kept)
    return {t: BUILDERS[t](kept, splits, max_per_doc) for t in tasks}


def task_stats(items: list[MCItem]) -> dict:
    by = Counter((it.split, it.source) for it in items)
    return {"items": len(items), "documents": len({it.doc_id for it in items}),
            "per_split": {s: sum(v for (sp, _), v in by.items() if sp == s) for s in SPLITS},
            "per_split_source": {f"{s}/{src}": v for (s, src), v in sorted(by.items())}}


# ----------------------------------------------------------------------------------------------------------------
# describe: what fitted controllers moved, with labels and evidence.


def describe(controllers: Path, db: str | None, top: int = 10, evidence: int = 1) -> dict:
    """Per task: the prototypes the seeds' prototype controllers raised and lowered most, with label, category and
    the top evidence snippet when a precompute database is given."""
    from bench.controllers import top_moved
    from prism.controllers import load_controller

    con = None
    if db is not None:
        from precompute import query

        con = query.open_db(db)
    out: dict = {}
    for task_dir in sorted(p for p in controllers.iterdir() if p.is_dir() and p.name != "cache"):
        fitted = [load_controller(p) for p in sorted(task_dir.glob("prototype-*.safetensors"))]
        if not fitted:
            continue
        moved = top_moved(fitted, top)
        for rows in moved.values():
            for row in rows:
                if con is not None:
                    card = query.prototype_card(con, row["prototype_id"])
                    row["label"], row["category"] = card["label"], card["category"]
                    row["evidence"] = [{"doc_id": e["doc_id"], "token": e["token"], "activation": e["activation"],
                                        "text": "".join(s["text"] for s in e["segments"])}
                                       for e in query.evidence(con, row["prototype_id"], limit=evidence)]
        out[task_dir.name] = moved
    if con is not None:
        con.close()
    return out


# ----------------------------------------------------------------------------------------------------------------
# Command line.


def _split_source(args: argparse.Namespace) -> tuple[str, float]:
    if args.checkpoint:
        train_args = Path(args.checkpoint).parent / "train_args.json"
        if not train_args.is_file():
            raise FileNotFoundError(f"no {train_args}: give --corpus and --val-fraction instead")
        saved = json.loads(train_args.read_text())
        return args.corpus or saved["corpus"], args.val_fraction if args.val_fraction is not None else \
            saved["val_fraction"]
    if not args.corpus or args.val_fraction is None:
        raise ValueError("give --checkpoint (its run's train_args.json names the corpus and val_fraction) or both "
                         "--corpus and --val-fraction")
    return args.corpus, args.val_fraction


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("python -m bench.controller_tasks", __doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    build = cli.subparser(commands, "build", help="write one items file per task (TASK.jsonl) into --out")
    build.add_argument("--checkpoint", help="a checkpoint folder; its run's train_args.json gives corpus and "
                                            "val_fraction")
    build.add_argument("--corpus", help="corpus spec ('default', a file/folder/glob) when not from --checkpoint")
    build.add_argument("--val-fraction", type=float, help="the training run's held-out fraction")
    build.add_argument("--out", required=True, help="folder for the task files")
    build.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS), help="which tasks to build")
    build.add_argument("--max-per-doc", type=int, default=48, help="items per document and task at most")
    build.add_argument("--stats", action="store_true", help="print item counts per split and source as JSON")
    desc = cli.subparser(commands, "describe", help="label the prototypes fitted controllers moved (JSON)")
    desc.add_argument("--controllers", required=True, help="the folder `python -m bench.controllers fit` wrote")
    desc.add_argument("--db", help="precompute database for labels and evidence")
    desc.add_argument("--top", type=int, default=10, help="prototypes per direction")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = cli.parse(parser, argv)
    with cli.expected_errors(parser, ValueError, FileNotFoundError):
        if args.command == "describe":
            result = describe(Path(args.controllers), args.db, args.top)
        else:
            corpus, val_fraction = _split_source(args)
            built = build_tasks(iter_documents(corpus), val_fraction, args.max_per_doc, args.tasks)
            out = Path(args.out)
            result = {}
            for task, items in built.items():
                write_items(items, out / f"{task}.jsonl")
                result[task] = task_stats(items)
                logger.info("%s: %d items -> %s", task, len(items), out / f"{task}.jsonl")
            (out / "tasks.json").write_text(json.dumps({"corpus": corpus, "val_fraction": val_fraction,
                                                        "max_per_doc": args.max_per_doc, "stats": result},
                                                       indent=2))
            if not args.stats:
                return result
    cli.print_json(result, indent=2)  # the command's output
    return result


if __name__ == "__main__":
    main()
