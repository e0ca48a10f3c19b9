"""Detection scores of a database's stored labels, offline and (with an endpoint) by an LLM: one JSON line.

    python -m bench.label_detection --db assets/prism-default.duckdb
    python -m bench.label_detection --db runs/v3/full.duckdb --endpoint http://127.0.0.1:8000/v1 --llm-model NAME \
        --limit 100

Offline (precompute/labels/detection.py, every live prototype): the held-out detection balanced accuracy of each
stored label against random contexts and against its siblings' held-out contexts, with the marked scorer (the
label's claims checked on the context whose evidence token is marked, plus the sentence embedding) and with the
embedding alone; and the explanation-free intruder check (how often the one context of another prototype among
N_INTRUDER_SET + 1 is the least similar: how coherent the evidence is with no label at all; chance 0.2).

With --endpoint and --llm-model (an OpenAI-compatible chat API, as `--labeler openai` uses), an LLM scorer too, on
--limit seeded prototypes: it reads the label and a shuffled list of contexts with the token in «guillemets»
(held-out contexts of the prototype, as many random ones from the negative pool, as many of its siblings') and
answers the numbers of the contexts where the label fits; the balanced accuracy against random and against
siblings is computed from that answer. The API key, if any, is read from --api-key-env, never stored.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import duckdb
import numpy as np

from precompute.embed import embed
from precompute.labels import detection
from prism import cli

logger = logging.getLogger("bench.label_detection")

GOALS = {"detection_random": 0.85, "detection_sibling": 0.75}
SCORER_PROMPT = ("You check explanations of a language-model feature. Each numbered context has one token in "
                 "«guillemets». The explanation says where the feature fires and what it pushes the next token "
                 "toward. Answer with one JSON object {\"fires\": [numbers]} listing the contexts where the "
                 "explanation fits the marked token.")


def stored_labels(con: duckdb.DuckDBPyConnection) -> dict[int, str]:
    return {int(p): label for p, label in con.execute(
        "SELECT l.prototype_id, l.label FROM labels l JOIN prototype_stats s USING (prototype_id) "
        "WHERE s.activation_count > 0 AND l.label IS NOT NULL ORDER BY 1").fetchall()}


def offline(ctx, pool, labels: dict[int, str], seed: int = 0) -> dict:
    """Mean held-out detection accuracies of the labels (marked scorer and embedding alone) and the intruder check."""
    ids = sorted(p for p in labels if p in ctx.cards)
    vectors = embed([labels[p] for p in ids])
    out: dict = {}
    for name, marked in (("marked", True), ("embedding", False)):
        scores = [detection.detection_scores(ctx, pool, p, labels[p], v, marked=marked)
                  for p, v in zip(ids, vectors, strict=True)]
        rand = [r for r, _ in scores if r is not None]
        sib = [s for _, s in scores if s is not None]
        out[name] = {"detection_random": round(float(np.mean(rand)), 4) if rand else None,
                     "detection_sibling": round(float(np.mean(sib)), 4) if sib else None,
                     "with_random": len(rand), "with_siblings": len(sib)}
    accuracy, tried = detection.intruder_accuracy(ctx, pool, seed)
    out["intruder"] = {"accuracy": round(accuracy, 4), "prototypes": tried,
                       "chance": round(1 / (detection.N_INTRUDER_SET + 1), 4)}
    return out


def _evidence_by_row(ctx) -> dict:
    """{row of ctx.vectors: its EvidenceContext}."""
    return {ctx.index[(pid, e.rank)]: e for pid, card in ctx.cards.items() for e in card.evidence}


def parse_fires(text: str, n: int) -> set[int]:
    """The context numbers (1..n) of an LLM scorer's reply: a JSON object {"fires": [...]}, else the numbers in it."""
    match = re.search(r"\{.*\}", text, re.DOTALL)
    numbers: list = []
    if match:
        try:
            numbers = list(json.loads(match.group(0)).get("fires", []))
        except (json.JSONDecodeError, AttributeError, TypeError):
            numbers = []
    if not numbers:
        numbers = re.findall(r"\d+", text)
    out = set()
    for x in numbers:
        try:
            i = int(x)
        except (TypeError, ValueError):
            continue
        if 1 <= i <= n:
            out.add(i)
    return out


def llm(ctx, pool, labels: dict[int, str], complete, limit: int, seed: int = 0) -> dict:
    """The LLM scorer (module docstring) on `limit` seeded prototypes; complete(prompt) -> reply text."""
    rng = np.random.default_rng(seed)
    candidates = [p for p in sorted(labels) if p in ctx.cards and ctx.rows(p, held_out=True)]
    picked = sorted(int(p) for p in rng.choice(candidates, size=min(limit, len(candidates)), replace=False))
    pool_rows = detection.pool_rows(ctx, pool)
    by_row = _evidence_by_row(ctx)  # once: the prompts show marked contexts of many rows
    rand_scores, sib_scores, failures = [], [], 0
    for pid in picked:
        held = ctx.rows(pid, held_out=True)
        others = pool_rows[pool.prototype_ids != pid]
        negatives = [int(r) for r in rng.choice(others, size=min(len(held), len(others)), replace=False)]
        sib_rows = [r for s in ctx.sibling_ids(pid) for r in ctx.rows(s, held_out=True)]
        siblings = [int(r) for r in rng.choice(sib_rows, size=min(len(held), len(sib_rows)), replace=False)] \
            if sib_rows else []
        rows = [(r, "pos") for r in held] + [(r, "rand") for r in negatives] + [(r, "sib") for r in siblings]
        order = rng.permutation(len(rows))
        rows = [rows[i] for i in order]
        texts = [by_row[r].marked(before=24, after=4) for r, _ in rows]
        prompt = (f"{SCORER_PROMPT}\n\nExplanation: {labels[pid]}\n\n"
                  + "\n".join(f"{i + 1}. {t}" for i, t in enumerate(texts)))
        try:
            fires = parse_fires(complete(prompt), len(rows))
        except Exception as err:  # a failed request counts, it does not end the run
            failures += 1
            logger.warning("prototype %d: %s", pid, err)
            continue
        said = {kind: [i + 1 in fires for i, (_, k) in enumerate(rows) if k == kind] for kind in ("pos", "rand", "sib")}
        hit = float(np.mean(said["pos"]))
        rand_scores.append((hit + 1 - float(np.mean(said["rand"]))) / 2)
        if said["sib"]:
            sib_scores.append((hit + 1 - float(np.mean(said["sib"]))) / 2)
    return {"prototypes": len(picked), "failed": failures,
            "detection_random": round(float(np.mean(rand_scores)), 4) if rand_scores else None,
            "detection_sibling": round(float(np.mean(sib_scores)), 4) if sib_scores else None}


def main(argv: list[str] | None = None) -> dict:
    parser = cli.parser("python -m bench.label_detection", __doc__)
    parser.add_argument("--db", required=True, help="a precompute database with labels")
    parser.add_argument("--seed", type=int, default=0, help="seed of the intruder draws and the LLM sample")
    parser.add_argument("--endpoint", help="an OpenAI-compatible API root for the LLM scorer")
    parser.add_argument("--llm-model", help="the LLM scorer's model name")
    parser.add_argument("--api-key-env", default="OPENAI_API_KEY", help="environment variable with the API key")
    parser.add_argument("--limit", type=int, default=100, help="prototypes the LLM scorer reads")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per LLM request")
    args = cli.parse(parser, argv)
    if bool(args.endpoint) != bool(args.llm_model):
        cli.fail(parser, "the LLM scorer needs both --endpoint and --llm-model")
    if args.limit < 1:
        cli.fail(parser, f"--limit must be >= 1, got {args.limit}")
    with cli.expected_errors(parser, FileNotFoundError, ValueError, duckdb.Error, RuntimeError):
        if not Path(args.db).is_file():
            raise FileNotFoundError(f"no database at {args.db}")
        from bench.label_goals import job_context

        con = duckdb.connect(args.db, read_only=True)
        try:
            labels = stored_labels(con)
            if not labels:
                raise ValueError(f"{args.db} has no labels: run the labels job first")
            pool, ctx = job_context(con)
        finally:
            con.close()
        result: dict = {"db": str(args.db), "goals": GOALS, **offline(ctx, pool, labels, args.seed)}
        if args.endpoint:
            from precompute.labels.llm import OpenAICompatibleLabeler

            client = OpenAICompatibleLabeler(args.endpoint, args.llm_model, os.environ.get(args.api_key_env),
                                             args.timeout)
            result["llm"] = {"model": args.llm_model, **llm(ctx, pool, labels, client.complete_with(SCORER_PROMPT),
                                                            args.limit, args.seed)}
    cli.print_json(result)
    return result


if __name__ == "__main__":
    main()
