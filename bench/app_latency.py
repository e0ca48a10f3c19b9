"""Latency of the app's logic on a real-size model: token selection -> decomposition panel, prototype search
(label and semantic), and generation with per-token decomposition vs plain model.generate of the same tokens.
Prints one JSON line.

    python bench/app_latency.py                                     # the shipped default model and database
    python bench/app_latency.py --model runs/m --db out.duckdb
    python bench/app_latency.py --backbone smollm2 --n-prototypes 1024 --top-k 8   # random bank, no database

Selection is measured twice: the first selection of a generation and later ones. Since the generation keeps the
state z each token was chosen from (Step.state), the first selection runs no forward pass either; `recompute_s` is
what a click costs where that state was not kept (a text longer than limits.keep_states_tokens): one forward pass
over the text. The figures include building the plotly figures, i.e. everything the panel needs except the
browser's drawing.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app import plots  # noqa: E402
from app.assets import resolve_db, resolve_model  # noqa: E402
from app.core import GenerationSettings, Studio  # noqa: E402
from prism import PrismConfig, PrismForCausalLM, cli  # noqa: E402

PROMPT = "The river flows into the sea, and the people of the valley have always"


def percentiles(values: list[float]) -> dict:
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(round(q * (len(values) - 1))))]  # noqa: E731
    return {"p50_ms": round(pick(0.5) * 1000, 2), "p95_ms": round(pick(0.95) * 1000, 2), "n": len(values)}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def load_studio(args) -> tuple[Studio, str]:
    if args.backbone:
        from prism.backbones import load_backbone, load_tokenizer

        model = PrismForCausalLM.from_backbone(load_backbone(args.backbone),
                                               PrismConfig(n_prototypes=args.n_prototypes, top_k=args.top_k))
        return Studio(model.eval(), load_tokenizer(args.backbone)), f"{args.backbone} (random bank)"
    model_path = resolve_model(args.model)
    return Studio.load(model_path, resolve_db(args.db, model_given=args.model is not None)), str(model_path)


def main(argv: list[str] | None = None) -> dict:
    parser = cli.parser("python bench/app_latency.py", __doc__)
    parser.add_argument("--model", default=None, help="PRISM model folder (default: the shipped assets/model)")
    parser.add_argument("--db", default=None, help="precompute database (default: the shipped one)")
    parser.add_argument("--backbone", default=None, help="instead of --model: wrap this backbone with a random bank")
    parser.add_argument("--n-prototypes", type=int, default=1024, help="bank size with --backbone")
    parser.add_argument("--top-k", type=int, default=8, help="active prototypes with --backbone")
    parser.add_argument("--tokens", type=int, default=48, help="tokens generated per run")
    parser.add_argument("--repeats", type=int, default=5, help="generation runs of each kind (alternating)")
    parser.add_argument("--selections", type=int, default=30, help="later token selections timed")
    parser.add_argument("--first", type=int, default=20, help="first selections timed (one generation each)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    studio, name = load_studio(args)
    settings = GenerationSettings(PROMPT, max_new_tokens=args.tokens)
    ids = torch.tensor([studio.encode_prompt(settings)[0]])

    # generation: the app's stream (per-token prototypes kept) vs plain generate, alternating, same tokens
    studio.generate(settings)  # warm-up
    app_times, plain_times, recompute = [], [], []
    for _ in range(args.repeats):
        gen = None

        def run_app():
            nonlocal gen
            gen = studio.generate(settings)

        app_times.append(timed(run_app))
        recompute.append(timed(lambda g=gen: studio.final_states(g)))
        out = []
        plain_times.append(timed(lambda out=out: out.append(studio.model.generate(ids, args.tokens))))
        assert out[0][0, ids.shape[1]:].tolist() == gen.token_ids, "the app generated other tokens"

    # selection -> everything the decomposition panel shows
    def select(g, index):
        view = studio.token_view(g, index)
        plots.decomposition_figure(view.chosen)
        plots.alternatives_figure(view)

    first, later = [], []
    for n in range(args.first):  # a fresh generation each time (another seed: sampled, so another text)
        g = studio.generate(GenerationSettings(PROMPT, max_new_tokens=args.tokens, temperature=0.8, seed=n))
        first.append(timed(lambda g=g, n=n: select(g, n % len(g.steps))))
    for n in range(args.selections):
        later.append(timed(lambda n=n: select(gen, n % args.tokens)))

    result = {"bench": "app_latency", "model": name, "database": str(studio.db.path) if studio.db else None,
              "tokens": args.tokens, "threads": torch.get_num_threads(),
              "generate_plain_s": round(statistics.median(plain_times), 4),
              "generate_app_s": round(statistics.median(app_times), 4),
              "ratio_app_vs_plain": round(statistics.median(app_times) / statistics.median(plain_times), 4),
              "recompute_s": round(statistics.median(recompute), 4),
              "select_first": percentiles(first), "select_cached": percentiles(later)}
    if studio.db is not None:
        db = studio.db
        words = [w for label, _ in list(db.labels.values())[:50] for w in label.split()[:1]] or ["a"]
        result["search_label"] = percentiles([timed(lambda w=w: db.search(w, "label")) for w in words[:30]])
        if db.has_embeddings:
            db.search("warm up", "semantic")
            result["search_semantic"] = percentiles([timed(lambda w=w: db.search(f"{w} words", "semantic"))
                                                     for w in words[:30]])
    cli.print_json(result)
    return result


if __name__ == "__main__":
    main()
