"""Do the labels of the prototypes that explain a token fit its context? One JSON line (issue 37's modern-text goal).

    python -m bench.label_relevance --model assets/model --db assets/prism-default.duckdb
    python -m bench.label_relevance --model runs/v3/prism/final --db runs/v3/full.duckdb --top 3 --seed 0

On the modern-English probe passages (prism/probe.py: written for the project, in no corpus), the model explains
its own top token at every position; the `--top` prototypes with the largest positive contribution to that logit
are the explaining ones. Each explaining prototype's label text (what search embeds: "category - topic: label",
precompute.search.label_text) is embedded and compared with the context the prototype saw (the last
precompute.labels.cards.WINDOW_BEFORE + 1 tokens up to the position); the same number of seeded random labelled
prototypes give the negatives at the same positions. The score is the AUROC of cos(explaining label, context) over
cos(random label, context): 0.5 = the explaining labels fit the context no better than random labels, 1 = always
better. Reported overall and per kind of passage, with the prototypes' share of the explained logits (their
contributions over |logit|, so the number says how much of the prediction the labelled prototypes carry).
"""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import numpy as np
import torch

from precompute.embed import embed
from precompute.labels.cards import WINDOW_BEFORE
from precompute.labels.scoring import auroc
from precompute.search import label_text
from prism import cli

GOAL = 0.75


def load_labels(con: duckdb.DuckDBPyConnection) -> dict[int, str]:
    """{prototype_id: the label text search embeds} of every labelled live prototype."""
    columns = {r[0] for r in con.execute("DESCRIBE labels").fetchall()}
    topic = "l.topic" if "topic" in columns else "NULL"
    rows = con.execute(f"""SELECT l.prototype_id, l.category, l.label, {topic} FROM labels l
                           JOIN prototype_stats s USING (prototype_id)
                           WHERE s.activation_count > 0 ORDER BY l.prototype_id""").fetchall()
    return {int(pid): label_text(category, label, top) for pid, category, label, top in rows if label}


def explaining(model, ids: torch.Tensor, top: int) -> list[tuple[int, list[int], float]]:
    """Per position t of one sequence (1, T): (t, the `top` prototypes with the largest positive contribution to
    the model's own top token's logit, their summed contribution over |logit|)."""
    out = model(ids)
    rows = []
    for t in range(ids.shape[1]):
        d = model.decompose_output(out, t)[0]
        ranked = sorted(((c, p) for p, c in zip(d.prototype_ids, d.contributions, strict=True) if c > 0),
                        reverse=True)[:top]
        if ranked:
            rows.append((t, [p for _, p in ranked], sum(c for c, _ in ranked) / max(abs(d.logit), 1e-9)))
    return rows


def collect(model, tokenizer, labels: dict[int, str], top: int = 3, seed: int = 0) -> list[tuple]:
    """(kind, context, explaining ids, random ids, share) per explained position of the probe passages."""
    from prism.eval import probe_sequences

    rng = np.random.default_rng(seed)
    pool = np.array(sorted(labels))
    items = []
    with torch.no_grad():
        for kind, seq in probe_sequences(tokenizer, getattr(model, "max_length", None)):
            ids = torch.as_tensor(seq, dtype=torch.long)[None, :]
            for t, pids, share in explaining(model, ids, top):
                pids = [p for p in pids if p in labels]
                if not pids or t == 0:
                    continue
                context = tokenizer.decode(seq[max(1, t - WINDOW_BEFORE):t + 1]).strip()
                others = [int(x) for x in rng.choice(pool, size=len(pids), replace=False)]
                items.append((kind, context, pids, others, share))
    return items


def score(items: list[tuple], labels: dict[int, str]) -> dict:
    """The AUROC of cos(explaining label, context) over cos(random label, context), overall and per kind."""
    texts = sorted({labels[p] for _, _, a, b, _ in items for p in a + b})
    label_vectors = dict(zip(texts, embed(texts, progress=False), strict=True))
    contexts = embed([c for _, c, _, _, _ in items])  # (n, D)

    def part(subset) -> dict:
        pos = [float(label_vectors[labels[p]] @ contexts[i]) for i in subset for p in items[i][2]]
        neg = [float(label_vectors[labels[p]] @ contexts[i]) for i in subset for p in items[i][3]]
        return {"positions": len(subset), "auroc": round(auroc(np.array(pos), np.array(neg)), 4),
                "mean_cos_explaining": round(float(np.mean(pos)), 4), "mean_cos_random": round(float(np.mean(neg)), 4),
                "explained_share": round(float(np.median([items[i][4] for i in subset])), 4)}

    result = part(range(len(items)))
    for kind in dict.fromkeys(k for k, _, _, _, _ in items):
        result[kind] = part([i for i, it in enumerate(items) if it[0] == kind])
    return result


def measure(model, tokenizer, labels: dict[int, str], top: int = 3, seed: int = 0) -> dict:
    return {"top": top, "seed": seed, "goal": GOAL, **score(collect(model, tokenizer, labels, top, seed), labels)}


def build_parser():
    parser = cli.parser("python -m bench.label_relevance", __doc__)
    parser.add_argument("--model", default="assets/model", help="the PRISM model folder")
    parser.add_argument("--db", default="assets/prism-default.duckdb", help="its precompute database (labels)")
    parser.add_argument("--top", type=int, default=3, help="explaining prototypes per position")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random labels")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = cli.parse(parser, argv)
    if args.top < 1:
        cli.fail(parser, f"--top must be >= 1, got {args.top}")
    with cli.expected_errors(parser, FileNotFoundError, ValueError, duckdb.Error):
        if not Path(args.db).is_file():
            raise FileNotFoundError(f"no database at {args.db}")
        from prism import PrismForCausalLM
        from prism.backbones import load_tokenizer

        con = duckdb.connect(args.db, read_only=True)
        try:
            labels = load_labels(con)
        finally:
            con.close()
        if not labels:
            raise ValueError(f"{args.db} has no labels: run the labels job first")
        model = PrismForCausalLM.from_pretrained(args.model).eval()
        tokenizer = load_tokenizer(model.config.backbone)
        result = {"model": str(args.model), "db": str(args.db), **measure(model, tokenizer, labels, args.top,
                                                                          args.seed)}
    print(json.dumps(result))  # noqa: T201 - the command's output
    return result


if __name__ == "__main__":
    main()
