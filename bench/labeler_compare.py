"""A local instruct model as labeler beside labeler v2, both held-out scores on the same prototypes (issue 14).

    python -m bench.labeler_compare --db runs/labels-v2.duckdb --n 50 --cache runs/llm-labels.json

--db is a database whose labels job ran with the default labeler (v2, precompute/labels/contrast.py). The script draws n
live prototypes (seeded), has the local instruct model (default: SmolLM2-135M-Instruct, the shipped backbone,
converted by prism.backbones; never downloaded) label each from the same visible (even-ranked) evidence v2 saw, and
scores both labels the way the labels job does: label_score against the job's seeded sample of other prototypes'
contexts, sibling_score against the siblings' held-out contexts. The model answers once per prototype (greedy, at
most --max-new-tokens): a reply with the JSON the prompt asks for gives its label; otherwise the "label" field of a
cut-off JSON, else the reply's first line, is taken as the label (counted in llm_not_json), so every prototype gets a
label to score. The model's labels are kept in --cache (JSON) so a second run only scores. Prints one JSON line.
"""

from __future__ import annotations

import json
import logging
import random
import re
import statistics
from pathlib import Path

import duckdb

from precompute.labels import (
    MAX_LABEL_CHARS,
    N_NEGATIVES,
    LocalInstructLabeler,
    build_prompt,
    contrast,
    load_cards,
    negative_pool,
    parse_reply,
)
from prism import cli

logger = logging.getLogger("bench.labeler_compare")


def pick(con: duckdb.DuckDBPyConnection, n: int, seed: int) -> list[int]:
    """n seeded random prototypes with at least 4 evidence rows (2 visible, 2 held out)."""
    ids = [r[0] for r in con.execute("SELECT prototype_id FROM evidence GROUP BY prototype_id HAVING count(*) >= 4 "
                                     "ORDER BY prototype_id").fetchall()]
    return sorted(random.Random(seed).sample(ids, min(n, len(ids))))


def llm_labels(con: duckdb.DuckDBPyConnection, ids: list[int], model: str, cache: Path | None,
               max_new_tokens: int, prompt_evidence: int = 12) -> dict[str, dict]:
    """{prototype_id (str): {category, label, explanation} or {error}}, from the cache where it has them."""
    done = json.loads(cache.read_text()) if cache is not None and cache.is_file() else {}
    todo = [i for i in ids if str(i) not in done]
    if todo:
        labeler = LocalInstructLabeler(model, max_new_tokens=max_new_tokens)
        for card in load_cards(con, todo):
            train, _ = card.split()
            reply = labeler._complete(build_prompt(train, n_evidence=prompt_evidence))
            done[str(card.prototype_id)] = lenient_label(reply)
            logger.info("prototype %d: %s", card.prototype_id, done[str(card.prototype_id)])
            if cache is not None:
                cache.write_text(json.dumps(done, indent=1, sort_keys=True))
    return done


def lenient_label(reply: str) -> dict:
    """{label, json (whether the reply held the JSON asked for), reply (its start)} from one model reply."""
    try:
        r = parse_reply(reply)
        return {"label": r.label, "category": r.category, "json": True, "reply": reply[:200]}
    except ValueError:
        pass
    match = re.search(r'"label"\s*:\s*"([^"]+)', reply)
    lines = [line.strip() for line in reply.splitlines() if line.strip()]
    label = match.group(1) if match else (lines[0] if lines else "")
    return {"label": " ".join(label.split())[:MAX_LABEL_CHARS] or "(empty reply)", "json": False,
            "reply": reply[:200]}


def _mean(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.fmean(values), 4) if values else None


def main(argv: list[str] | None = None) -> dict:
    parser = cli.parser("python -m bench.labeler_compare", __doc__, formatter="plain")
    parser.add_argument("--db", required=True, help="a database labelled by the default labeler (v2)")
    parser.add_argument("--n", type=int, default=50, help="prototypes compared")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draw")
    parser.add_argument("--llm-model", default=None,
                        help="local instruct model folder (default: the converted SmolLM2-135M-Instruct)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="the JSON's label comes first: 48 reach it")
    parser.add_argument("--prompt-evidence", type=int, default=6,
                        help="evidence contexts in the prompt (the labels job's prompt has 12; a 135M model copes "
                             "better with fewer)")
    parser.add_argument("--only-cached", action="store_true",
                        help="compare only the drawn prototypes the cache already labels (no model run)")
    parser.add_argument("--cache", type=Path, default=None, help="JSON file keeping the model's labels")
    args = cli.parse(parser, argv)
    model = args.llm_model
    if model is None:
        from prism.backbones import smollm2_folder

        model = str(smollm2_folder())
    con = duckdb.connect(args.db, read_only=True)
    try:
        job = json.loads(con.execute("SELECT args_json FROM runs WHERE job = 'labels'").fetchone()[0])
        ids = pick(con, args.n, args.seed)
        if args.only_cached:
            cached = json.loads(args.cache.read_text()) if args.cache is not None and args.cache.is_file() else {}
            ids = [i for i in ids if str(i) in cached]
        llm = llm_labels(con, ids, model, args.cache, args.max_new_tokens, args.prompt_evidence)
        v2 = {pid: (label, score, sib) for pid, label, score, sib in con.execute(
            "SELECT prototype_id, label, label_score, sibling_score FROM labels WHERE list_contains(?, prototype_id)",
            [ids]).fetchall()}
        pool = negative_pool(con, job.get("n_negatives", N_NEGATIVES), job.get("seed", 0))
        ctx = contrast.build_context(con, pool, job.get("seed", 0))
        ok = [i for i in ids if "label" in llm[str(i)]]
        scores = dict(zip(ok, contrast.score_labels(ctx, pool, [(i, llm[str(i)]["label"]) for i in ok]),
                          strict=True))
    finally:
        con.close()
    rows = [{"prototype_id": i, "v2": v2[i][0], "v2_label_score": v2[i][1], "v2_sibling_score": v2[i][2],
             "llm": llm[str(i)].get("label"), "llm_label_score": scores.get(i, (None, None))[0],
             "llm_sibling_score": scores.get(i, (None, None))[1]} for i in ids]
    on_ok = [r for r in rows if r["llm"] is not None]
    result = {
        "db": args.db, "n": len(ids), "drawn": args.n, "seed": args.seed, "llm_model": Path(model).name,
        "prompt_evidence": args.prompt_evidence, "max_new_tokens": args.max_new_tokens, "v2_labeler": job["labeler"],
        "llm_not_json": sum(1 for i in ids if not llm[str(i)].get("json")),
        "llm_distinct_labels": len({r["llm"] for r in on_ok}),
        "v2_distinct_labels": len({r["v2"] for r in rows}),
        "mean_label_score": {"v2": _mean([r["v2_label_score"] for r in rows]),
                             "llm": _mean([r["llm_label_score"] for r in on_ok]),
                             "v2_where_llm_labelled": _mean([r["v2_label_score"] for r in on_ok])},
        "mean_sibling_score": {"v2": _mean([r["v2_sibling_score"] for r in rows]),
                               "llm": _mean([r["llm_sibling_score"] for r in on_ok]),
                               "v2_where_llm_labelled": _mean([r["v2_sibling_score"] for r in on_ok])},
        "llm_wins_label_score": sum(1 for r in on_ok if r["llm_label_score"] is not None
                                    and r["v2_label_score"] is not None
                                    and r["llm_label_score"] > r["v2_label_score"]),
        "rows": rows,
    }
    cli.print_json(result)
    return result


if __name__ == "__main__":
    main()
