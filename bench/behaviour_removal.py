"""Behaviour removal: switch a preset's prototypes off, by removing their slices and by re-routing, and measure the
behaviour's rate, the continuations' fluency and the cost elsewhere, side by side on the same prompts and seeds.

    python -m bench.behaviour_removal --model assets/model --db assets/prism-default.duckdb --preset kjv-register
    python -m bench.behaviour_removal --model assets/model --db DB --preset kjv-register,numbers  # DB holding both

Prompts are the first --prompt-words words of a seeded choice of lines from held-out documents of the default
corpus (documents the model never trained on): verses for the King James register, Wikipedia and news paragraphs
for numbers. Each prompt is continued with --max-new-tokens sampled tokens as the model is ("before") and with the
preset suppressed in each --modes ("zero": the slices removed; "reroute": the prototypes masked out of the top-k
so the nearest others take their slots), with the same seeds. The behaviour's rate is counted in the continuations
only: markers per 100 words, and the share of continuations with at least one.

Fluency: the continuations' perplexity given the prompt under the untouched backbone (a judge no condition
changes), so a suppression that removes the markers by breaking the text shows it. Cost: perplexity on held-out
Wikipedia and news text, scored on the tokens that are not the preset's markers ("other"; for numbers the digits
and number words themselves are what is removed, so they are scored apart as "markers"); for the register also on
held-out King James text (expected to rise).

Prints one JSON line per preset (also written to --out): per condition the rate, the judge's perplexity and the held-out
perplexities; per mode their change against "before" and whether the goals are met (rate -70% or more, judge
perplexity at most x1.5, other-text perplexity within 2%); how much of the model's own prototype activity on each
held-out source the preset covers (active_share_*); the preset's size; and example continuations.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import re
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from precompute.presets import PRESETS, REASONS, PresetArgs, find_prototypes, preset_prototypes
from precompute.runs import connect
from prism import Interventions, PrismForCausalLM, cli
from prism.backbones import load_backbone, load_tokenizer
from prism.corpora import iter_documents
from prism.data import is_validation, pack
from prism.model import SUPPRESS_MODES

logger = logging.getLogger("bench.behaviour_removal")

# preset -> the corpus sources whose held-out documents give the prompts
PROMPTS = {"kjv-register": ("kjv",), "numbers": ("wiki", "news")}
OTHER_SOURCES = ("wiki", "news")  # the cost is measured on held-out text of these
GOALS = {"rate_drop": 0.70, "judge_ratio": 1.5, "ppl_other_change": 0.02}


def held_out(corpus: str, val_fraction: float, split: str = "val") -> dict[str, list]:
    """Documents of one split of the corpus by source: {source: [Document, ...]} in corpus order. "val" is the
    training run's held-out split; "train" the rest (for tuning a preset's rule without touching held-out prompts)."""
    by_source: dict[str, list] = {}
    for doc in iter_documents(corpus):
        if is_validation(doc.doc_id, val_fraction) == (split == "val"):
            by_source.setdefault(doc.source, []).append(doc)
    return by_source


def make_prompts(docs: list, n: int, words: int, seed: int) -> list[str]:
    """n prompts: the first `words` words of lines (verses, paragraphs) with at least 2 * words words, a seeded
    choice."""
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


def marker_token_ids(tokenizer, spec) -> torch.Tensor:
    """Ids of the vocabulary tokens that are markers of the preset (stripped, lower-cased text is a marker word or
    fully matches its token pattern), as the presets job decides it in SQL."""
    words = set(spec.markers)
    token_re = re.compile(spec.token_pattern) if spec.token_pattern else None
    ids = [i for i in range(len(tokenizer))
           if (t := tokenizer.decode([i]).strip().lower()) in words or (token_re and token_re.fullmatch(t))]
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def perplexity(model: PrismForCausalLM, tokenizer, docs: list, interventions: Interventions | None,
               max_tokens: int, seq_len: int, batch_size: int, markers: torch.Tensor | None = None,
               ) -> dict[str, dict[str, float]]:
    """Next-token perplexity over packed blocks of the documents: "all" targets, and with markers given, split into
    "other" (targets that are not markers) and "markers" (targets that are)."""
    blocks = _blocks(tokenizer, docs, max_tokens, seq_len)
    sums = {"all": [0.0, 0], "other": [0.0, 0], "markers": [0.0, 0]}
    for lo in tqdm(range(0, len(blocks), batch_size), desc="perplexity", unit="batch", leave=False):
        ids = torch.from_numpy(blocks[lo: lo + batch_size].astype(np.int64))  # (B, T)
        logits = model(ids, interventions=interventions).logits[:, :-1].float()  # (B, T-1, V)
        target = ids[:, 1:]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                reduction="none")  # (B*(T-1),)
        is_marker = torch.isin(target.reshape(-1), markers) if markers is not None else torch.zeros_like(nll).bool()
        for name, keep in (("all", torch.ones_like(is_marker)), ("other", ~is_marker), ("markers", is_marker)):
            sums[name][0] += float(nll[keep].sum())
            sums[name][1] += int(keep.sum())
    return {name: {"perplexity": math.exp(total / n) if n else float("nan"), "tokens": n}
            for name, (total, n) in sums.items()}


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


def run(args: argparse.Namespace, preset: str, loaded: dict | None = None) -> dict:
    """One preset's measurement (module docstring). The model and tokenizer are loaded from args.model once the
    preset's prototypes are found, and kept in `loaded` for the next preset."""
    spec = PRESETS[preset]
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes or set(modes) - set(SUPPRESS_MODES):
        raise ValueError(f"--modes must be a non-empty subset of {', '.join(SUPPRESS_MODES)}, got {args.modes!r}")
    rule = None  # checked before anything heavy is loaded
    if (args.rules, args.signature_top, args.min_share) != (None, None, None):  # any rule option: a variant
        rule = PresetArgs(min_share=args.min_share, signature_top=args.signature_top,
                          rules=REASONS if args.rules is None else
                          tuple(r.strip() for r in args.rules.split(",") if r.strip()))
    con = connect(args.db, read_only=True)
    try:
        if rule is None:  # the stored preset, exactly what the app's button applies
            found = preset_prototypes(con, preset)
        else:  # a variant of the rule, found afresh (read-only) for tuning
            found = [{"prototype_id": pid, "reasons": reasons}
                     for pid, reasons in find_prototypes(con, spec, rule).items()]
    finally:
        con.close()
    if not found:
        raise ValueError(f"the database holds no prototypes for preset {preset!r}: run "
                         "python -m precompute.presets --db ... first")
    loaded = {} if loaded is None else loaded
    if "model" not in loaded:
        loaded["model"] = PrismForCausalLM.from_pretrained(args.model).eval()
        loaded["tokenizer"] = load_tokenizer(str(args.model))
    model, tokenizer = loaded["model"], loaded["tokenizer"]
    ids = [r["prototype_id"] for r in found]
    conditions = {"before": None, **{m: Interventions(suppress=frozenset(ids), suppress_mode=m) for m in modes}}
    docs = held_out(args.corpus, args.val_fraction, args.prompt_split)
    sources = PROMPTS[preset]
    pattern = spec.marker_pattern()
    prompts = make_prompts([d for s in sources for d in docs.get(s, [])], args.prompts, args.prompt_words,
                           args.seed)
    gen, gen_ids = {}, {}
    for name, iv in conditions.items():
        gen_ids[name] = []
        gen[name] = continuations(model, tokenizer, prompts, iv, args.max_new_tokens, args.batch_size, args.seed,
                                  args.temperature, args.top_p, token_ids=gen_ids[name])
    per = {name: {"rate": rate(texts, pattern)} for name, texts in gen.items()}
    judge_spec = None
    if not args.no_judge:
        judge_spec = args.judge or model.config.backbone
        if not judge_spec:
            raise ValueError("the model names no backbone to judge fluency with: give --judge or --no-judge")
        judge = load_backbone(judge_spec)
        for name, token_ids in gen_ids.items():
            per[name]["judge_ppl"] = judge_perplexity(judge, tokenizer, prompts, token_ids)["perplexity"]
        del judge
    shares, other_tokens = {}, None
    if not args.skip_perplexity:  # on held-out text unless tuning asks for training text (--eval-split train)
        val = docs if args.prompt_split == args.eval_split else held_out(args.corpus, args.val_fraction,
                                                                         args.eval_split)
        other = [d for s in OTHER_SOURCES for d in val.get(s, [])]
        markers = marker_token_ids(tokenizer, spec)
        extra = [s for s in sources if s not in OTHER_SOURCES]  # the register's own source (expected to rise)
        for name, iv in conditions.items():
            ppl = perplexity(model, tokenizer, other, iv, args.max_eval_tokens, args.seq_len, args.batch_size,
                             markers)
            per[name]["ppl_other"] = ppl["other"]["perplexity"]
            per[name]["ppl_markers"] = ppl["markers"]["perplexity"]
            other_tokens = {"other": ppl["other"]["tokens"], "markers": ppl["markers"]["tokens"]}
            for source in extra:
                per[name][f"ppl_{source}"] = perplexity(model, tokenizer, val[source], iv, args.max_eval_tokens,
                                                        args.seq_len, args.batch_size)["all"]["perplexity"]
        shares = {f"active_share_{name}": active_share(model, tokenizer, ds, ids, args.max_eval_tokens,
                                                        args.seq_len, args.batch_size)
                  for name, ds in (("other", other), *((s, val[s]) for s in extra))}
    before = per["before"]
    for mode in modes:
        after = per[mode]
        b, a = before["rate"], after["rate"]
        after["rate_drop"] = 1 - a["markers_per_100_words"] / b["markers_per_100_words"] \
            if b["markers_per_100_words"] else float("nan")
        after["share_drop"] = 1 - a["share_with_marker"] / b["share_with_marker"] \
            if b["share_with_marker"] else float("nan")
        goals = {"rate_drop_at_least_0.70": bool(after["rate_drop"] >= GOALS["rate_drop"])}
        if "judge_ppl" in after:
            after["judge_ratio"] = after["judge_ppl"] / before["judge_ppl"]
            goals["judge_ratio_at_most_1.5"] = bool(after["judge_ratio"] <= GOALS["judge_ratio"])
        if "ppl_other" in after:
            after["ppl_other_change"] = after["ppl_other"] / before["ppl_other"] - 1
            goals["ppl_other_within_0.02"] = bool(abs(after["ppl_other_change"]) <= GOALS["ppl_other_change"])
        after["goals"] = goals
        after["all_goals_met"] = all(goals.values())
    reasons: dict[str, int] = {}
    for r in found:
        for reason in r["reasons"]:
            reasons[reason] = reasons.get(reason, 0) + 1
    examples = [{"prompt": p, **{name: gen[name][n] for name in conditions}}
                for n, p in enumerate(prompts[: args.examples])]
    return {
        "preset": preset, "rule": "stored" if rule is None else
        {"rules": ",".join(rule.rules), "signature_top": rule.for_preset(spec)[1],
         "min_share": rule.for_preset(spec)[0]},
        "n_prototypes": len(ids), "share_of_bank": len(ids) / model.config.n_prototypes, "reasons": reasons,
        "prompt_split": args.prompt_split, "eval_split": args.eval_split, "prompt_sources": list(sources),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
        "seed": args.seed, "judge": judge_spec, "other_tokens": other_tokens, "modes": list(modes),
        **per, **shares, "examples": examples,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("python -m bench.behaviour_removal", __doc__)
    parser.add_argument("--model", required=True, help="PRISM checkpoint folder with its tokenizer")
    parser.add_argument("--db", required=True, help="precompute database with the presets job done")
    parser.add_argument("--preset", default="kjv-register",
                        help="preset(s) to measure, comma-separated (one JSON line each, the model loaded once): "
                             + ", ".join(sorted(PROMPTS)))
    parser.add_argument("--modes", default=",".join(SUPPRESS_MODES),
                        help="suppression modes measured side by side: comma-separated subset of "
                             + ", ".join(SUPPRESS_MODES))
    parser.add_argument("--corpus", default="default", help="the corpus the model was trained on")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="the training run's held-out fraction")
    parser.add_argument("--prompt-split", choices=("val", "train"), default="val",
                        help="documents the prompts come from: held-out (the measurement) or training (tuning)")
    parser.add_argument("--skip-perplexity", action="store_true", help="rates only (tuning)")
    parser.add_argument("--eval-split", choices=("val", "train"), default="val",
                        help="documents the perplexities are measured on: held-out (the measurement) or training "
                             "(tuning a rule without looking at held-out text)")
    parser.add_argument("--judge", default=None,
                        help="model that scores the continuations' fluency (default: the model's untouched backbone)")
    parser.add_argument("--no-judge", action="store_true", help="skip the fluency score")
    tune = parser.add_argument_group("rule variant (tuning): find the prototypes afresh instead of the stored preset")
    tune.add_argument("--rules", help="comma-separated subset of " + ", ".join(REASONS))
    tune.add_argument("--signature-top", type=int, default=None,
                      help="signature rule's top tokens (default: the preset's own, precompute/presets.py)")
    tune.add_argument("--min-share", type=float, default=None,
                      help="next_token rule's share (default: the preset's own)")
    parser.add_argument("--prompts", type=int, default=200, help="prompts drawn from held-out documents")
    parser.add_argument("--prompt-words", type=int, default=8, help="words per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per prompt")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass")
    parser.add_argument("--batch-size", type=int, default=20, help="prompts generated at once")
    parser.add_argument("--max-eval-tokens", type=int, default=40960, help="held-out tokens per perplexity")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per window when scoring")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and the sampling")
    parser.add_argument("--examples", type=int, default=8, help="continuation pairs kept in the output")
    parser.add_argument("--out", help="also write the JSON here")
    return parser


def main(argv: list[str] | None = None) -> dict | list[dict]:
    parser = build_parser()
    args = cli.parse(parser, argv)
    for name in ("prompts", "prompt_words", "max_new_tokens", "batch_size", "max_eval_tokens", "seq_len"):
        if getattr(args, name) < 1:
            cli.fail(parser, f"--{name.replace('_', '-')} must be >= 1")
    presets = [p.strip() for p in args.preset.split(",") if p.strip()]
    unknown = sorted(set(presets) - set(PROMPTS))
    if unknown or not presets:
        cli.fail(parser, f"--preset must name presets among {', '.join(sorted(PROMPTS))}, got {args.preset!r}")
    results, loaded = [], {}
    # a bad rule variant (PresetArgs) raises one of these too
    with cli.expected_errors(parser, ValueError, FileNotFoundError, KeyError, OSError):
        for preset in presets:
            results.append(run(args, preset, loaded))
            cli.print_json(results[-1])
            if args.out:  # one line per preset, written as each finishes
                Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in results))
    for result in results:
        if not math.isfinite(result[result["modes"][0]]["rate_drop"]):
            logger.warning("%s: the prompts produced no marker before suppression: the rate drop is undefined",
                           result["preset"])
    return results[0] if len(results) == 1 else results


if __name__ == "__main__":
    main()
