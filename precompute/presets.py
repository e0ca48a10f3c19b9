"""Intervention presets: named sets of prototypes, found in the database by a stated rule, that switch a behaviour
off in one click. The app offers them as buttons; bench/behaviour_removal.py measures exactly the stored set.

    python -m precompute.presets --db out.duckdb                      # the job: find and store every preset
    python -m precompute.presets --db out.duckdb --show kjv-register  # list a stored preset's prototypes

A preset names a behaviour by its markers: words (the King James register: thee, thou, hath, unto, saith, ...) and,
optionally, a token pattern (numbers: any run of digits; SmolLM2 writes a number digit by digit). Its prototypes
are those the database ties to the markers in any of three ways; each prototype keeps its reasons:
- label:      a token its label names is a marker: the tokens it fires on or pushes toward, and the words before
              or after it that the label names ("'unto' after 'said' → names (Moses)": unto, said, Moses), never the
              context words of "near ..." / "with ..." lists (they describe the surroundings, not the tokens);
- next_token: at least --min-share of the tokens that follow its evidence (next_tokens) are marker words, so the
              prototype is active where the corpus writes them next;
- signature:  a marker is among the top --signature-top tokens of its logit signature W p_i, so its slice
              pushes the markers up wherever it is active.
Each preset has its own min_share and signature_top (chosen on training-split prompts with bench/behaviour_removal.py,
stated below); --min-share / --signature-top override them for every preset.
Needs the evidence job (next_tokens, logit_signatures) and, for the label rule, the labels job. The job is cheap
(a few SQL queries) and idempotent like every job: its arguments are stored, other arguments need --overwrite.
"""

from __future__ import annotations

import argparse
import logging
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import duckdb

from precompute.inputs import Context, Inputs, Job
from precompute.runs import JobArgsMismatch, connect, finish_job, start_job, transaction
from prism import cli

logger = logging.getLogger("precompute.presets")

NAME = "presets"  # the job's row in `runs`, its tables in schema.JOB_TABLES
REASONS = ("label", "next_token", "signature")


@dataclass(frozen=True)
class PresetSpec:
    name: str  # stable id, used in the database, the app and the API
    title: str  # what the app's button says
    description: str
    markers: tuple[str, ...]  # lower-case marker words of the behaviour
    token_pattern: str | None = None  # a token whose stripped text fully matches this regex is a marker too
    min_share: float = 0.3  # next_token rule: share of markers among the tokens after the evidence
    signature_top: int = 20  # signature rule: how many of W p_i's top tokens are looked at (the evidence job keeps 20)
    marker_kinds: tuple[str, ...] = ()  # label rule: a label naming tokens of these kinds (tokens.KIND_PHRASES) counts

    def marker_pattern(self) -> re.Pattern:
        """Whole-word, case-insensitive match of any marker (for counting them in text); a run of tokens matching
        token_pattern (e.g. the digits of one number) counts once."""
        words = [re.escape(m) for m in self.markers]
        if self.token_pattern:
            words.append(f"(?:{self.token_pattern})")
        return re.compile(r"\b(" + "|".join(words) + r")\b", re.IGNORECASE)

    def is_marker_sql(self, column: str) -> tuple[str, list]:
        """A SQL condition on a token column, with its parameters: the stripped, lower-cased token is a marker."""
        sql, params = f"list_contains(?, lower(trim({column})))", [list(self.markers)]
        if self.token_pattern:
            sql, params = f"({sql} OR regexp_full_match(trim({column}), ?))", [*params, self.token_pattern]
        return sql, params


NUMBER_WORDS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
                "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty",
                "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety", "hundred", "thousand",
                "million", "billion")

PRESETS: dict[str, PresetSpec] = {spec.name: spec for spec in (
    PresetSpec(
        name="kjv-register",
        title="Remove the King James register",
        description="Suppress the prototypes behind the archaic pronouns and verb forms the King James Bible "
                    "teaches (thee, thou, thy, hath, unto, saith, ...). Measured on held-out verse prompts by "
                    "bench/behaviour_removal.py (docs/RESULTS.md): re-routed, the model writes far fewer of them "
                    "and stays fluent; with the slices only removed, biblical continuations break.",
        markers=("thee", "thou", "thy", "thine", "ye", "hath", "hast", "doth", "dost", "saith", "shalt", "wilt",
                 "unto", "spake", "begat"),
        marker_kinds=("archaic pronoun", "archaic form"),
    ),
    PresetSpec(
        name="numbers",
        title="Remove numbers and dates",
        description="Suppress the prototypes behind numbers: digits, years and number words. On held-out "
                    "Wikipedia and news prompts, re-routed, the model writes about 70% fewer numbers and stays "
                    "fluent, but perplexity on the other words rises about 10%, so the shipped database does not "
                    "include it (bench/behaviour_removal.py, docs/RESULTS.md).",
        markers=NUMBER_WORDS,
        token_pattern="[0-9]+",
        signature_top=5,
        marker_kinds=("number", "number word", "year"),
    ),
)}


@dataclass
class PresetArgs:
    min_share: float | None = None  # override every preset's next_token share (None: each preset's own)
    signature_top: int | None = None  # override every preset's signature depth (None: each preset's own)
    rules: tuple[str, ...] = REASONS
    presets: tuple[str, ...] = field(default_factory=lambda: tuple(PRESETS))

    def __post_init__(self) -> None:
        if self.min_share is not None and not 0 < self.min_share <= 1:
            raise ValueError(f"--min-share must be in (0, 1], got {self.min_share}")
        if self.signature_top is not None and self.signature_top < 1:
            raise ValueError(f"--signature-top must be >= 1, got {self.signature_top}")
        unknown = sorted(set(self.rules) - set(REASONS))
        if unknown or not self.rules:
            raise ValueError(f"rules must be a non-empty subset of {', '.join(REASONS)}, got {list(self.rules)}")
        unknown = sorted(set(self.presets) - set(PRESETS))
        if unknown:
            raise ValueError(f"unknown presets {unknown}; known: {', '.join(PRESETS)}")

    def for_preset(self, spec: PresetSpec) -> tuple[float, int]:
        """(min_share, signature_top) for one preset: the override, else the preset's own."""
        return (spec.min_share if self.min_share is None else self.min_share,
                spec.signature_top if self.signature_top is None else self.signature_top)


def label_names_marker(spec: PresetSpec, label: str) -> bool:
    """Whether a token the label names (precompute.labels.detection.parse_claims: the tokens it fires on, the piece
    before or after, what it pushes toward) is one of the preset's markers, or the label names the preset's
    marker_kinds ("archaic 2nd-person pronouns", "→ numbers (3, 12)")."""
    from precompute.labels.detection import parse_claims

    claims = parse_claims(label)
    named = claims.tokens | claims.after | claims.before
    pattern = spec.marker_pattern()
    return any(t and pattern.fullmatch(t) for t in named) or \
        bool(set(spec.marker_kinds) & (claims.kinds | claims.before_kinds))


def find_prototypes(con: duckdb.DuckDBPyConnection, spec: PresetSpec, args: PresetArgs) -> dict[int, list[str]]:
    """{prototype_id: [reasons]} for one preset (module docstring). Token texts are compared stripped and
    lower-cased, so ' Thee' and 'thee' both count."""
    min_share, signature_top = args.for_preset(spec)
    is_marker, params = spec.is_marker_sql("token")
    found: dict[int, list[str]] = {}

    def add(rows, reason):
        for (pid,) in rows:
            found.setdefault(int(pid), []).append(reason)

    if "label" in args.rules:
        add([(pid,) for pid, label in con.execute("SELECT prototype_id, label FROM labels ORDER BY 1").fetchall()
             if label and label_names_marker(spec, label)], "label")
    if "next_token" in args.rules:
        add(con.execute(f"""
            SELECT prototype_id FROM next_tokens
            GROUP BY prototype_id
            HAVING sum(count) FILTER (WHERE {is_marker}) >= ? * sum(count)
            ORDER BY 1""", [*params, min_share]).fetchall(), "next_token")
    if "signature" in args.rules:
        add(con.execute(f"""
            SELECT DISTINCT prototype_id FROM logit_signatures
            WHERE rank < ? AND {is_marker}
            ORDER BY 1""", [signature_top, *params]).fetchall(), "signature")
    return dict(sorted(found.items()))


def run(con: duckdb.DuckDBPyConnection, args: PresetArgs, overwrite: bool = False) -> dict[str, int]:
    """Find and store every preset in args.presets; returns {name: number of prototypes}."""
    status = start_job(con, NAME, asdict(args), overwrite=overwrite)
    if status == "done":
        stored = dict(con.execute("SELECT name, count(*) FROM presets GROUP BY name").fetchall())
        return {name: stored.get(name, 0) for name in args.presets}
    if "label" in args.rules and con.execute("SELECT count(*) FROM labels").fetchone()[0] == 0:
        raise RuntimeError("the label rule needs the labels job: run it first (or leave 'label' out of --rules)")
    if con.execute("SELECT count(*) FROM next_tokens").fetchone()[0] == 0:
        raise RuntimeError("presets need the evidence job's next_tokens and logit_signatures: run it first")
    counts = {}
    with transaction(con):  # every preset at once: a killed job leaves nothing and simply runs again
        con.execute("DELETE FROM presets")
        for name in args.presets:
            found = find_prototypes(con, PRESETS[name], args)
            if found:
                con.executemany("INSERT INTO presets VALUES (?, ?, ?)",
                                [[name, pid, reasons] for pid, reasons in found.items()])
            counts[name] = len(found)
            logger.info("preset %s: %d prototypes", name, len(found))
        finish_job(con, NAME)
    return counts


def preset_prototypes(con: duckdb.DuckDBPyConnection, name: str) -> list[dict]:
    """A stored preset's prototypes, [{prototype_id, reasons, label, category}], in id order."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    cur = con.execute("""
        SELECT p.prototype_id, p.reasons, l.label, l.category
        FROM presets p LEFT JOIN labels l USING (prototype_id)
        WHERE p.name = ? ORDER BY p.prototype_id""", [name])
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def run_job(context: Context) -> dict[str, int]:
    """The job interface (precompute/inputs.py)."""
    return run(context.inputs.connection(), context.args, overwrite=context.overwrite)


JOB = Job(NAME, PresetArgs, run_job, args_from=lambda ns: PresetArgs())


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("python -m precompute.presets", __doc__)
    own = "; ".join(f"{p.name}: {p.min_share:g}, {p.signature_top}" for p in PRESETS.values())
    parser.add_argument("--db", required=True, help="the precompute DuckDB file (evidence and labels jobs done)")
    parser.add_argument("--min-share", type=float, default=None,
                        help="next_token rule: share of markers among the tokens that follow the evidence, for every "
                             f"preset (default: each preset's own; min_share, signature_top = {own})")
    parser.add_argument("--signature-top", type=int, default=None,
                        help="signature rule: top tokens of W p_i looked at, for every preset (default: each "
                             "preset's own)")
    parser.add_argument("--rules", default=",".join(REASONS), help="comma-separated subset of " + ", ".join(REASONS))
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma-separated subset of " + ", ".join(PRESETS))
    parser.add_argument("--overwrite", action="store_true", help="replace presets found with other arguments")
    parser.add_argument("--show", metavar="NAME", help="list a stored preset's prototypes (read-only) and stop")
    return parser


def preset_args(ns: argparse.Namespace) -> PresetArgs:
    split = lambda text: tuple(s.strip() for s in text.split(",") if s.strip())  # noqa: E731
    return PresetArgs(min_share=ns.min_share, signature_top=ns.signature_top, rules=split(ns.rules),
                      presets=split(ns.presets))


def main(argv: list[str] | None = None) -> dict | list[dict]:
    parser = build_parser()
    ns = cli.parse(parser, argv)
    with cli.expected_errors(parser, JobArgsMismatch, RuntimeError, ValueError, KeyError, FileNotFoundError,
                             duckdb.Error):
        if ns.show:
            con = connect(ns.db, read_only=True)
            try:
                rows = preset_prototypes(con, ns.show)
            finally:
                con.close()
            for r in rows:
                print(f"{r['prototype_id']:>6}  {','.join(r['reasons']):<28} {r['category']}: {r['label']}")  # noqa: T201
            return rows
        args = preset_args(ns)
        if not Path(ns.db).is_file():
            raise FileNotFoundError(f"no database at {ns.db}: run the evidence and labels jobs first")
        with Inputs(ns.db) as inputs:
            counts = JOB.run(Context(inputs, args, ns.overwrite))
    print("presets: " + ", ".join(f"{name} {n} prototypes" for name, n in counts.items()))  # noqa: T201
    return counts


if __name__ == "__main__":
    main()
