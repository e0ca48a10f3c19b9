"""Behaviour removal: switch a preset's prototypes off and measure the behaviour's rate and the cost elsewhere.

    python -m bench.behaviour_removal --model assets/model --db assets/prism-default.duckdb --preset kjv-register

For the King James register (precompute/presets.py): prompts are the first --prompt-words words of verses from the
held-out King James chapters of the default corpus (documents the model never trained on); each prompt is continued
with --max-new-tokens sampled tokens, once as the model is and once with the preset's prototypes suppressed, with
the same seeds. The behaviour's rate is counted in the continuations only: marker words per 100 words, and the
share of continuations with at least one marker. The cost is held-out perplexity on the other sources (Wikipedia
and news documents of the validation split), with and without the suppression; perplexity on held-out King James
text is reported too (it is expected to rise: that register is what is removed).

Prints one JSON line (also written to --out): prompts, rates before/after and their relative drop, perplexities
before/after and the relative change, the preset's size, and a few example continuation pairs.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from precompute.corpus import iter_documents
from precompute.presets import PRESETS, preset_prototypes
from precompute.runs import connect
from prism import Interventions, PrismForCausalLM
from prism.backbones import load_tokenizer
from prism.data import is_validation, pack
from prism.eval import evaluate_lm

logger = logging.getLogger("bench.behaviour_removal")

SOURCES = {"kjv-register": "kjv"}  # preset -> the corpus source whose held-out documents give the prompts


def held_out(corpus: str, val_fraction: float) -> dict[str, list]:
    """Validation documents of the corpus by source: {source: [Document, ...]} in corpus order."""
    by_source: dict[str, list] = {}
    for doc in iter_documents(corpus):
        if is_validation(doc.doc_id, val_fraction):
            by_source.setdefault(doc.source, []).append(doc)
    return by_source


def make_prompts(docs: list, n: int, words: int, seed: int) -> list[str]:
    """n prompts: the first `words` words of lines (verses) with at least 2 * words words, a seeded choice."""
    lines = [line.split() for doc in docs for line in doc.text.splitlines()]
    lines = [line for line in lines if len(line) >= 2 * words]
    if len(lines) < n:
        raise ValueError(f"only {len(lines)} held-out lines of >= {2 * words} words for {n} prompts")
    chosen = random.Random(seed).sample(range(len(lines)), n)
    return [" ".join(lines[i][:words]) for i in sorted(chosen)]


@torch.no_grad()
def continuations(model: PrismForCausalLM, tokenizer, prompts: list[str], interventions: Interventions | None,
                  max_new_tokens: int, batch_size: int, seed: int, temperature: float, top_p: float) -> list[str]:
    """Sampled continuations (text only), batched with left padding; batch b uses seed + b in both conditions."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = []
    for b, lo in enumerate(tqdm(range(0, len(prompts), batch_size), desc="generating", unit="batch", leave=False)):
        encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts[lo: lo + batch_size]]
        width = max(len(e) for e in encoded)
        ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded])  # (B, T) left-padded
        mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
        steps = [s.token_ids for s in model.stream(ids, max_new_tokens, interventions=interventions,
                                                   attention_mask=mask, do_sample=True, temperature=temperature,
                                                   top_p=top_p, seed=seed + b)]
        new = torch.stack(steps, dim=1)  # (B, n)
        out += tokenizer.batch_decode(new, skip_special_tokens=True)
    return out


def rate(texts: list[str], pattern) -> dict[str, float]:
    words = sum(len(t.split()) for t in texts)
    hits = [len(pattern.findall(t)) for t in texts]
    return {"markers_per_100_words": 100 * sum(hits) / max(words, 1),
            "share_with_marker": sum(h > 0 for h in hits) / max(len(texts), 1),
            "markers": sum(hits), "words": words}


def perplexity(model: PrismForCausalLM, tokenizer, docs: list, interventions: Interventions | None,
               max_tokens: int, seq_len: int, batch_size: int) -> dict[str, float]:
    stream = np.concatenate([np.asarray(tokenizer(d.text, add_special_tokens=False)["input_ids"] +
                                        [tokenizer.eos_token_id], dtype=np.int32) for d in docs])
    blocks = pack(stream, seq_len)[: max(1, max_tokens // seq_len)]
    return evaluate_lm(lambda ids: model(ids, interventions=interventions).logits, blocks, batch_size,
                       "perplexity")


def run(args: argparse.Namespace) -> dict:
    spec = PRESETS[args.preset]
    model = PrismForCausalLM.from_pretrained(args.model).eval()
    tokenizer = load_tokenizer(str(args.model))
    con = connect(args.db, read_only=True)
    try:
        found = preset_prototypes(con, args.preset)
    finally:
        con.close()
    if not found:
        raise ValueError(f"the database holds no prototypes for preset {args.preset!r}: run "
                         "python -m precompute.presets --db ... first")
    ids = [r["prototype_id"] for r in found]
    suppress = Interventions(suppress=frozenset(ids))
    docs = held_out(args.corpus, args.val_fraction)
    source = SOURCES[args.preset]
    prompts = make_prompts(docs.get(source, []), args.prompts, args.prompt_words, args.seed)
    pattern = spec.marker_pattern()
    gen = {}
    for name, iv in (("before", None), ("after", suppress)):
        gen[name] = continuations(model, tokenizer, prompts, iv, args.max_new_tokens, args.batch_size, args.seed,
                                  args.temperature, args.top_p)
    rates = {name: rate(texts, pattern) for name, texts in gen.items()}
    other = [d for s, ds in sorted(docs.items()) if s != source for d in ds]
    ppl = {}
    for name, iv in (("before", None), ("after", suppress)):
        ppl[name] = {"other": perplexity(model, tokenizer, other, iv, args.max_eval_tokens, args.seq_len,
                                         args.batch_size),
                     source: perplexity(model, tokenizer, docs[source], iv, args.max_eval_tokens, args.seq_len,
                                        args.batch_size)}
    before, after = rates["before"], rates["after"]
    drop = 1 - after["markers_per_100_words"] / before["markers_per_100_words"] \
        if before["markers_per_100_words"] else float("nan")
    other_change = ppl["after"]["other"]["perplexity"] / ppl["before"]["other"]["perplexity"] - 1
    reasons: dict[str, int] = {}
    for r in found:
        for reason in r["reasons"]:
            reasons[reason] = reasons.get(reason, 0) + 1
    examples = [{"prompt": p, "before": b, "after": a}
                for p, b, a in list(zip(prompts, gen["before"], gen["after"], strict=True))[: args.examples]]
    return {
        "preset": args.preset, "n_prototypes": len(ids), "share_of_bank": len(ids) / model.config.n_prototypes,
        "reasons": reasons, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "rate_before": before, "rate_after": after, "rate_drop": drop,
        "share_drop": 1 - after["share_with_marker"] / before["share_with_marker"]
        if before["share_with_marker"] else float("nan"),
        "ppl_other_before": ppl["before"]["other"]["perplexity"],
        "ppl_other_after": ppl["after"]["other"]["perplexity"],
        "ppl_other_change": other_change, "other_tokens": ppl["before"]["other"]["tokens"],
        f"ppl_{source}_before": ppl["before"][source]["perplexity"],
        f"ppl_{source}_after": ppl["after"][source]["perplexity"],
        "goals": {"rate_drop_at_least_0.70": bool(drop >= 0.70), "ppl_change_within_0.02": abs(other_change) <= 0.02},
        "examples": examples,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.behaviour_removal", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", required=True, help="PRISM checkpoint folder with its tokenizer")
    parser.add_argument("--db", required=True, help="precompute database with the presets job done")
    parser.add_argument("--preset", default="kjv-register", choices=sorted(SOURCES))
    parser.add_argument("--corpus", default="default", help="the corpus the model was trained on")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="the training run's held-out fraction")
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--prompt-words", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--max-eval-tokens", type=int, default=40960, help="held-out tokens per perplexity")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--examples", type=int, default=8, help="continuation pairs kept in the output")
    parser.add_argument("--out", help="also write the JSON here")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in ("prompts", "prompt_words", "max_new_tokens", "batch_size", "max_eval_tokens", "seq_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        result = run(args)
    except (ValueError, FileNotFoundError, KeyError) as err:
        parser.error(str(err))
    line = json.dumps(result)
    if args.out:
        Path(args.out).write_text(line + "\n")
    sys.stdout.write(line + "\n")
    if not math.isfinite(result["rate_drop"]):
        logger.warning("the prompts produced no marker word before suppression: the rate drop is undefined")
    return result


if __name__ == "__main__":
    main()
