"""Behaviour removal: switch a preset's prototypes off and measure the behaviour's rate and the cost elsewhere.

    python -m bench.behaviour_removal --model assets/model --db assets/prism-default.duckdb --preset kjv-register

For the King James register (precompute/presets.py): prompts are the first --prompt-words words of verses from the
held-out King James chapters of the default corpus (documents the model never trained on); each prompt is continued
with --max-new-tokens sampled tokens, once as the model is and once with the preset's prototypes suppressed, with
the same seeds. The behaviour's rate is counted in the continuations only: marker words per 100 words, and the
share of continuations with at least one marker. The cost is held-out perplexity on the other sources (Wikipedia
and news documents of the validation split), with and without the suppression; perplexity on held-out King James
text is reported too (it is expected to rise: that register is what is removed).

The continuations' fluency is scored too: their perplexity given the prompt under the untouched backbone (a judge
neither condition changes), so that a preset which removes the markers by breaking the text shows it.

Prints one JSON line (also written to --out): prompts, rates before/after and their relative drop, the judge's
perplexity of the continuations before/after, held-out perplexities before/after and the relative change, how
much of the model's own prototype activity on each held-out source the preset covers (active_share_*), the
preset's size, and a few example continuation pairs.
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
from precompute.presets import PRESETS, REASONS, PresetArgs, find_prototypes, preset_prototypes
from precompute.runs import connect
from prism import Interventions, PrismForCausalLM
from prism.backbones import load_backbone, load_tokenizer
from prism.data import is_validation, pack
from prism.eval import evaluate_lm

logger = logging.getLogger("bench.behaviour_removal")

SOURCES = {"kjv-register": "kjv"}  # preset -> the corpus source whose held-out documents give the prompts


def held_out(corpus: str, val_fraction: float, split: str = "val") -> dict[str, list]:
    """Documents of one split of the corpus by source: {source: [Document, ...]} in corpus order. "val" is the
    training run's held-out split; "train" the rest (for tuning a preset's rule without touching held-out prompts)."""
    by_source: dict[str, list] = {}
    for doc in iter_documents(corpus):
        if is_validation(doc.doc_id, val_fraction) == (split == "val"):
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
                  max_new_tokens: int, batch_size: int, seed: int, temperature: float, top_p: float,
                  token_ids: list | None = None) -> list[str]:
    """Sampled continuations (text), batched with left padding; batch b uses seed + b in both conditions.
    token_ids, when given, receives each continuation's token ids up to its first end-of-text."""
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
        if token_ids is not None:
            for row in new.tolist():
                token_ids.append(row[: row.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in row else row)
    return out


@torch.no_grad()
def judge_perplexity(judge, tokenizer, prompts: list[str], token_ids: list[list[int]]) -> dict[str, float]:
    """How fluent continuations are: the perplexity of their tokens given the prompt under a judge model (the
    untouched backbone, which neither condition changes). Gibberish scores high even where it has no marker."""
    nll, n = 0.0, 0
    for prompt, cont in zip(prompts, token_ids, strict=True):
        if not cont:
            continue
        head = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([head + cont])
        logits = judge(ids).logits[0, len(head) - 1: -1].float()
        nll += torch.nn.functional.cross_entropy(logits, torch.tensor(cont), reduction="sum").item()
        n += len(cont)
    return {"perplexity": math.exp(nll / n) if n else float("nan"), "tokens": n}


def rate(texts: list[str], pattern) -> dict[str, float]:
    words = sum(len(t.split()) for t in texts)
    hits = [len(pattern.findall(t)) for t in texts]
    return {"markers_per_100_words": 100 * sum(hits) / max(words, 1),
            "share_with_marker": sum(h > 0 for h in hits) / max(len(texts), 1),
            "markers": sum(hits), "words": words}


def _blocks(tokenizer, docs: list, max_tokens: int, seq_len: int) -> np.ndarray:
    stream = np.concatenate([np.asarray(tokenizer(d.text, add_special_tokens=False)["input_ids"] +
                                        [tokenizer.eos_token_id], dtype=np.int32) for d in docs])
    return pack(stream, seq_len)[: max(1, max_tokens // seq_len)]


def perplexity(model: PrismForCausalLM, tokenizer, docs: list, interventions: Interventions | None,
               max_tokens: int, seq_len: int, batch_size: int) -> dict[str, float]:
    blocks = _blocks(tokenizer, docs, max_tokens, seq_len)
    return evaluate_lm(lambda ids: model(ids, interventions=interventions).logits, blocks, batch_size,
                       "perplexity")


@torch.no_grad()
def active_share(model: PrismForCausalLM, tokenizer, docs: list, ids: list[int], max_tokens: int, seq_len: int,
                 batch_size: int) -> dict[str, float]:
    """How much of the model's own prototype activity on these documents belongs to the set: the share of active
    slots and of activation mass, and the share of positions where at least half of the k active prototypes are in
    it (where suppression leaves the prediction mostly to the residual)."""
    blocks = torch.from_numpy(_blocks(tokenizer, docs, max_tokens, seq_len).astype(np.int64))
    members = torch.tensor(sorted(ids))
    slots = mass = total = half = positions = 0.0
    for lo in range(0, len(blocks), batch_size):
        out = model(blocks[lo: lo + batch_size])
        inside = torch.isin(out.prototype_ids, members)  # (B, T, k)
        slots += inside.sum().item()
        mass += (out.activations * inside).sum().item()
        total += out.activations.sum().item()
        half += (2 * inside.sum(-1) >= inside.shape[-1]).sum().item()
        positions += inside.shape[0] * inside.shape[1]
    k = model.config.top_k
    return {"slots": slots / (positions * k), "activation_mass": mass / total if total else float("nan"),
            "positions_half_or_more": half / positions}


def run(args: argparse.Namespace) -> dict:
    spec = PRESETS[args.preset]
    rule = None  # checked before anything heavy is loaded
    if (args.rules, args.signature_top, args.min_share) != (None, None, None):  # any rule option: a variant
        defaults = PresetArgs()
        rule = PresetArgs(
            min_share=defaults.min_share if args.min_share is None else args.min_share,
            signature_top=defaults.signature_top if args.signature_top is None else args.signature_top,
            rules=defaults.rules if args.rules is None else
            tuple(r.strip() for r in args.rules.split(",") if r.strip()))
    con = connect(args.db, read_only=True)
    try:
        if rule is None:  # the stored preset, exactly what the app's button applies
            found = preset_prototypes(con, args.preset)
        else:  # a variant of the rule, found afresh (read-only) for tuning
            found = [{"prototype_id": pid, "reasons": reasons}
                     for pid, reasons in find_prototypes(con, PRESETS[args.preset], rule).items()]
    finally:
        con.close()
    if not found:
        raise ValueError(f"the database holds no prototypes for preset {args.preset!r}: run "
                         "python -m precompute.presets --db ... first")
    model = PrismForCausalLM.from_pretrained(args.model).eval()
    tokenizer = load_tokenizer(str(args.model))
    ids = [r["prototype_id"] for r in found]
    suppress = Interventions(suppress=frozenset(ids))
    docs = held_out(args.corpus, args.val_fraction, args.prompt_split)
    source = SOURCES[args.preset]
    prompts = make_prompts(docs.get(source, []), args.prompts, args.prompt_words, args.seed)
    pattern = spec.marker_pattern()
    gen, gen_ids = {}, {}
    for name, iv in (("before", None), ("after", suppress)):
        gen_ids[name] = []
        gen[name] = continuations(model, tokenizer, prompts, iv, args.max_new_tokens, args.batch_size, args.seed,
                                  args.temperature, args.top_p, token_ids=gen_ids[name])
    rates = {name: rate(texts, pattern) for name, texts in gen.items()}
    fluency = {}
    if not args.no_judge:
        judge_spec = args.judge or model.config.backbone
        if not judge_spec:
            raise ValueError("the model names no backbone to judge fluency with: give --judge or --no-judge")
        judge = load_backbone(judge_spec)
        judged = {name: judge_perplexity(judge, tokenizer, prompts, ids) for name, ids in gen_ids.items()}
        del judge
        fluency = {"judge": judge_spec, "judge_ppl_before": judged["before"]["perplexity"],
                   "judge_ppl_after": judged["after"]["perplexity"],
                   "judge_ppl_change": judged["after"]["perplexity"] / judged["before"]["perplexity"] - 1}
    before, after = rates["before"], rates["after"]
    drop = 1 - after["markers_per_100_words"] / before["markers_per_100_words"] \
        if before["markers_per_100_words"] else float("nan")
    result = {}
    if not args.skip_perplexity:  # always on held-out text, whatever split the prompts came from
        val = docs if args.prompt_split == "val" else held_out(args.corpus, args.val_fraction, "val")
        other = [d for s, ds in sorted(val.items()) if s != source for d in ds]
        ppl = {}
        for name, iv in (("before", None), ("after", suppress)):
            ppl[name] = {"other": perplexity(model, tokenizer, other, iv, args.max_eval_tokens, args.seq_len,
                                             args.batch_size),
                         source: perplexity(model, tokenizer, val[source], iv, args.max_eval_tokens, args.seq_len,
                                            args.batch_size)}
        other_change = ppl["after"]["other"]["perplexity"] / ppl["before"]["other"]["perplexity"] - 1
        share = {name: active_share(model, tokenizer, ds, ids, args.max_eval_tokens, args.seq_len, args.batch_size)
                 for name, ds in (("other", other), (source, val[source]))}
        result = {
            "active_share_other": share["other"], f"active_share_{source}": share[source],
            "ppl_other_before": ppl["before"]["other"]["perplexity"],
            "ppl_other_after": ppl["after"]["other"]["perplexity"],
            "ppl_other_change": other_change, "other_tokens": ppl["before"]["other"]["tokens"],
            f"ppl_{source}_before": ppl["before"][source]["perplexity"],
            f"ppl_{source}_after": ppl["after"][source]["perplexity"],
        }
    reasons: dict[str, int] = {}
    for r in found:
        for reason in r["reasons"]:
            reasons[reason] = reasons.get(reason, 0) + 1
    examples = [{"prompt": p, "before": b, "after": a}
                for p, b, a in list(zip(prompts, gen["before"], gen["after"], strict=True))[: args.examples]]
    goals = {"rate_drop_at_least_0.70": bool(drop >= 0.70)}
    if result:
        goals["ppl_change_within_0.02"] = abs(result["ppl_other_change"]) <= 0.02
    return {
        "preset": args.preset, "rule": "stored" if rule is None else
        {"rules": ",".join(rule.rules), "signature_top": rule.signature_top, "min_share": rule.min_share},
        "n_prototypes": len(ids), "share_of_bank": len(ids) / model.config.n_prototypes,
        "reasons": reasons, "prompt_split": args.prompt_split, "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens, "rate_before": before, "rate_after": after, "rate_drop": drop,
        "share_drop": 1 - after["share_with_marker"] / before["share_with_marker"]
        if before["share_with_marker"] else float("nan"),
        **fluency, **result, "goals": goals, "examples": examples,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.behaviour_removal", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", required=True, help="PRISM checkpoint folder with its tokenizer")
    parser.add_argument("--db", required=True, help="precompute database with the presets job done")
    parser.add_argument("--preset", default="kjv-register", choices=sorted(SOURCES))
    parser.add_argument("--corpus", default="default", help="the corpus the model was trained on")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="the training run's held-out fraction")
    parser.add_argument("--prompt-split", choices=("val", "train"), default="val",
                        help="documents the prompts come from: held-out (the measurement) or training (tuning)")
    parser.add_argument("--skip-perplexity", action="store_true", help="rates only (tuning)")
    parser.add_argument("--judge", default=None,
                        help="model that scores the continuations' fluency (default: the model's untouched backbone)")
    parser.add_argument("--no-judge", action="store_true", help="skip the fluency score")
    tune = parser.add_argument_group("rule variant (tuning): find the prototypes afresh instead of the stored preset")
    tune.add_argument("--rules", help="comma-separated subset of " + ", ".join(REASONS))
    tune.add_argument("--signature-top", type=int, default=None,
                      help=f"signature rule's top tokens (stored preset's rule: {PresetArgs.signature_top})")
    tune.add_argument("--min-share", type=float, default=None,
                      help=f"next_token rule's share (stored preset's rule: {PresetArgs.min_share})")
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
    except (ValueError, FileNotFoundError, KeyError) as err:  # a bad rule variant (PresetArgs) lands here too
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
