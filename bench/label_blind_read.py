"""A blind-read sheet for stored labels: prototypes drawn at random, each label beside its evidence (issue 37).

    python -m bench.label_blind_read sheet --db assets/prism-default.duckdb --seed 3737 --n 30 > sheet.md
    python -m bench.label_blind_read sheet --db runs/new.duckdb --against assets/prism-default.duckdb \
        --seed 3737 --n 30 --key runs/key.json > sheet.md
    python -m bench.label_blind_read score --verdicts runs/verdicts.json --key runs/key.json

`sheet` draws N live prototypes (random.Random(seed).sample over the live ids in order, the draw RESULTS' blind reads
use) and prints, for each, its top evidence contexts with the token in «guillemets», the next tokens its evidence
shows, the tokens its logit signature raises most, and its label (category, topic, "fires on" / "pushes"). With
--against, two databases' labels of the same prototypes are shown as A and B in a seeded random order; which is
which goes to --key only, so the reader judges without knowing.

`score` reads the reader's verdicts, a JSON object {prototype id: verdict} for one database or {prototype id:
{"A": verdict, "B": verdict}} for two, each verdict "right" (it says where the prototype fires and what follows,
category and topic included), "partial" (one side right, or the category or topic off) or "wrong", unblinds them
with the key and prints the counts per database. The reading is a person's; this command only keeps it honest.
"""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from pathlib import Path

import duckdb

from prism import cli

VERDICTS = ("right", "partial", "wrong")


def draw(con: duckdb.DuckDBPyConnection, n: int, seed: int) -> list[int]:
    """N live prototype ids (activation_count > 0), random.Random(seed).sample over them in id order."""
    live = [r[0] for r in con.execute("SELECT prototype_id FROM prototype_stats WHERE activation_count > 0 "
                                      "ORDER BY prototype_id").fetchall()]
    if n > len(live):
        raise ValueError(f"--n {n} is more than the {len(live)} live prototypes")
    return random.Random(seed).sample(live, n)


def stored_label(con: duckdb.DuckDBPyConnection, pid: int) -> dict:
    row = con.execute("SELECT category, topic, label, fires_on, pushes FROM labels WHERE prototype_id = ?",
                      [pid]).fetchone()
    if row is None:
        raise ValueError(f"prototype {pid} has no label")
    return dict(zip(("category", "topic", "label", "fires_on", "pushes"), row, strict=True))


def _label_lines(name: str, lab: dict) -> list[str]:
    head = f"- **{name}** [{lab['category']}" + (f" / {lab['topic']}" if lab["topic"] else "") + "]"
    if lab["fires_on"]:
        return [head, f"  - fires on: {lab['fires_on']}", f"  - pushes the next token toward: {lab['pushes'] or '-'}"]
    return [head + f" {lab['label']}"]


def sheet(db: str, against: str | None, n: int, seed: int, contexts: int) -> tuple[str, dict]:
    """(the markdown sheet, the key {prototype id: {"A": db, "B": db}}; empty for one database)."""
    from precompute.labels.cards import load_cards

    con = duckdb.connect(db, read_only=True)
    other = duckdb.connect(against, read_only=True) if against else None
    try:
        ids = draw(con, n, seed)
        if other is not None and draw(other, n, seed) != ids:
            raise ValueError(f"{db} and {against} have different live prototypes: not the same bank")
        rng = random.Random(seed + 1)
        lines = [f"# Blind read: {n} prototypes (seed {seed})", ""]
        key: dict = {}
        for card in load_cards(con, ids):
            pid = card.prototype_id
            lines += [f"## #{pid}", ""]
            for e in card.evidence[:contexts]:
                lines.append(f"{e.rank + 1}. {e.marked(30, 4)}")
            nexts = ", ".join(f"{t.strip() or repr(t)} ({c})" for t, c in card.next_tokens[:8])
            raised = ", ".join([t.strip() or repr(t) for t, v in card.logit_tokens if v > 0][:8])
            lines += ["", f"next tokens in its evidence: {nexts or '-'}", f"its signature raises: {raised or '-'}", ""]
            if other is None:
                lines += _label_lines("label", stored_label(con, pid))
            else:
                pair = [db, against]
                rng.shuffle(pair)
                key[str(pid)] = {"A": pair[0], "B": pair[1]}
                for name, path in zip("AB", pair, strict=True):
                    lines += _label_lines(name, stored_label(con if path == db else other, pid))
            lines += ["", "verdict: right / partial / wrong", ""]
        return "\n".join(lines), key
    finally:
        con.close()
        if other is not None:
            other.close()


def score(verdicts: dict, key: dict | None) -> dict:
    """Counts of right / partial / wrong per database (unblinded with the key), and the share right."""
    tallies: dict[str, Counter] = {}
    for pid, given in verdicts.items():
        if isinstance(given, str):
            given = {"label": given}
        elif key is None:
            raise ValueError("verdicts for A and B need the --key that the sheet wrote")
        for side, verdict in given.items():
            if verdict not in VERDICTS:
                raise ValueError(f"prototype {pid}: verdict {verdict!r} is not one of {', '.join(VERDICTS)}")
            if side == "label":
                name = "label"
            elif key is not None and str(pid) in key and side in key[str(pid)]:
                name = key[str(pid)][side]
            else:
                raise ValueError(f"prototype {pid}: no key for {side!r}")
            tallies.setdefault(name, Counter())[verdict] += 1
    return {name: {**{v: c[v] for v in VERDICTS}, "n": sum(c.values()),
                   "right_share": round(c["right"] / sum(c.values()), 3)} for name, c in tallies.items()}


def build_parser():
    parser = cli.parser("python -m bench.label_blind_read", __doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    s = cli.subparser(commands, "sheet", "print a blind-read sheet (markdown) on stdout")
    s.add_argument("--db", required=True, help="a precompute database with labels")
    s.add_argument("--against", help="a second database of the same bank: its labels shown beside, blind")
    s.add_argument("--key", help="with --against: where to write which label is which (required then)")
    s.add_argument("--n", type=int, default=30, help="prototypes drawn")
    s.add_argument("--seed", type=int, default=3737, help="seed of the draw (and of the A/B order)")
    s.add_argument("--contexts", type=int, default=6, help="evidence contexts shown per prototype")
    c = cli.subparser(commands, "score", "count the verdicts, unblinded")
    c.add_argument("--verdicts", required=True, help="JSON: {id: verdict} or {id: {'A': verdict, 'B': verdict}}")
    c.add_argument("--key", help="the key the sheet wrote (for A/B verdicts)")
    return parser


def main(argv: list[str] | None = None) -> dict | str:
    parser = build_parser()
    args = cli.parse(parser, argv)
    with cli.expected_errors(parser, FileNotFoundError, ValueError, duckdb.Error, json.JSONDecodeError):
        if args.command == "score":
            key = json.loads(Path(args.key).read_text()) if args.key else None
            result = score(json.loads(Path(args.verdicts).read_text()), key)
            cli.print_json(result)
            return result
        if args.n < 1 or args.contexts < 1:
            raise ValueError("--n and --contexts must be >= 1")
        if args.against and not args.key:
            raise ValueError("--against needs --key (the sheet must not show which label is which)")
        for path in (args.db, args.against):
            if path and not Path(path).is_file():
                raise FileNotFoundError(f"no database at {path}")
        text, key = sheet(args.db, args.against, args.n, args.seed, args.contexts)
        if args.key:
            Path(args.key).write_text(json.dumps(key, indent=1))
        sys.stdout.write(text + "\n")
        return text


if __name__ == "__main__":
    main()
