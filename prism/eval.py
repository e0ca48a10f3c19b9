"""Evaluate a PRISM checkpoint on held-out text, beside its dense baseline and the untouched backbone.

    python -m prism.eval --checkpoint runs/prism/final --dense runs/dense/final --out eval.json

Prints a table and writes JSON with, per model, validation cross-entropy and perplexity, and for PRISM the
prototype metrics of docs/DESIGN.md section 2 over the held-out tokens:
- fve:           fraction of the variance of z explained by z_hat, 1 - sum ||r||^2 / sum ||z - mean z||^2
- r1_bar:        mean over prototypes of max over tokens of cos(p_i, z_t)  (prototypes sit on data)
- r2:            mean over tokens of max over prototypes of cos(z_t, p_i)  (tokens are covered)
- mean_active:   mean number of prototypes with activation > 0 per token (at most top_k)
- dead_fraction: fraction of prototypes never active on the held-out tokens
The held-out split is the training run's (same corpus, val_fraction, max_tokens and seq_len, read from the
run's train_args.json beside the checkpoint) unless given explicitly.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from prism import PrismForCausalLM, cli
from prism.backbones import load_backbone, load_tokenizer
from prism.data import pack, tokenize_split
from prism.losses import ce_loss
from prism.train import TRAIN_ARGS

logger = logging.getLogger("prism.eval")


@torch.no_grad()
def evaluate_lm(logits_fn, blocks: np.ndarray, batch_size: int, desc: str) -> dict[str, float]:
    """Token-weighted mean next-token CE over blocks (N, T) and its perplexity. logits_fn(ids) -> (B, T, V)."""
    total, count = 0.0, 0
    for lo in tqdm(range(0, len(blocks), batch_size), desc=desc, unit="batch", leave=False):
        ids = torch.from_numpy(blocks[lo: lo + batch_size].astype(np.int64))
        n = ids.numel() - ids.shape[0]
        total += float(ce_loss(logits_fn(ids), ids)) * n
        count += n
    ce = total / max(count, 1)
    return {"ce": ce, "perplexity": math.exp(ce), "tokens": count}


@torch.no_grad()
def evaluate_prism(model: PrismForCausalLM, blocks: np.ndarray, batch_size: int) -> dict[str, float]:
    """CE and perplexity plus the prototype metrics (module docstring) over blocks (N, T)."""
    n_protos = model.config.n_prototypes
    best = torch.full((n_protos,), -1.0)  # max over tokens of cos(p_i, z_t)
    used = torch.zeros(n_protos, dtype=torch.bool)
    sums = dict(ce=0.0, r2=0.0, active=0.0, rec=0.0, resid_sq=0.0)
    z_sum, z_sq, n_tok, n_pred = None, 0.0, 0, 0
    for lo in tqdm(range(0, len(blocks), batch_size), desc="prism", unit="batch", leave=False):
        ids = torch.from_numpy(blocks[lo: lo + batch_size].astype(np.int64))
        out = model(ids, return_sims=True)
        z = out.z.reshape(-1, out.z.shape[-1]).double()  # (N, d)
        sims = out.sims.reshape(-1, n_protos)  # (N, K)
        active = out.activations > 0
        n = z.shape[0]
        pred = ids.numel() - ids.shape[0]
        sums["ce"] += float(ce_loss(out.logits, ids)) * pred
        sums["r2"] += float(sims.max(-1).values.sum())
        sums["active"] += float(active.sum())
        r = out.residual.reshape(-1, z.shape[-1]).double()
        sums["resid_sq"] += float(r.pow(2).sum())
        sums["rec"] += float((r.pow(2).sum(-1) / z.pow(2).sum(-1)).sum())
        best = torch.maximum(best, sims.max(0).values)
        used[out.prototype_ids[active].unique()] = True
        z_sum = z.sum(0) if z_sum is None else z_sum + z.sum(0)
        z_sq += float(z.pow(2).sum())
        n_tok += n
        n_pred += pred
    total_var = z_sq - float(z_sum.pow(2).sum()) / n_tok  # sum ||z - mean z||^2
    ce = sums["ce"] / n_pred
    return {
        "ce": ce, "perplexity": math.exp(ce), "tokens": n_pred,
        "fve": 1 - sums["resid_sq"] / total_var,
        "rec": sums["rec"] / n_tok,
        "r1_bar": float(best.mean()),
        "r2": sums["r2"] / n_tok,
        "mean_active": sums["active"] / n_tok,
        "dead_fraction": float((~used).float().mean()),
        "n_prototypes": n_protos, "top_k": model.config.top_k,
    }


def validation_blocks(args: argparse.Namespace, tokenizer) -> np.ndarray:
    """The held-out blocks: the training run's validation stream, read in corpus order. tokenize_split caps it at
    max_tokens x val_fraction (so small training runs do not tokenize much validation text); a --max-val-tokens
    beyond that cap raises it (the same stream, read further: a longer evaluation starts with the same blocks)."""
    max_tokens = args.max_tokens
    if max_tokens and args.max_val_tokens and args.val_fraction > 0:
        max_tokens = max(max_tokens, math.ceil(args.max_val_tokens / args.val_fraction) + 1)
    blocks = pack(tokenize_split(args.corpus, tokenizer, args.val_fraction, max_tokens)["val"], args.seq_len)
    if args.max_val_tokens:
        blocks = blocks[: max(1, args.max_val_tokens // args.seq_len)]
    if len(blocks) == 0:
        raise ValueError("the validation split has no complete block: lower --seq-len or raise --val-fraction")
    return blocks


def run(args: argparse.Namespace) -> dict:
    checkpoint = Path(args.checkpoint)
    train_args_file = checkpoint.parent / TRAIN_ARGS
    if train_args_file.exists():  # default to the training run's split
        saved = json.loads(train_args_file.read_text())
        for name in ("corpus", "val_fraction", "max_tokens", "seq_len"):
            if getattr(args, name) is None:
                setattr(args, name, saved[name])
    if args.corpus is None:
        raise ValueError("--corpus is needed (no train_args.json beside the checkpoint)")
    args.val_fraction = 0.05 if args.val_fraction is None else args.val_fraction
    args.seq_len = args.seq_len or 256

    model = PrismForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer_source = checkpoint if (checkpoint / "tokenizer_config.json").exists() else model.config.backbone
    tokenizer = load_tokenizer(str(tokenizer_source))
    blocks = validation_blocks(args, tokenizer)
    logger.info("evaluating on %d held-out blocks of %d tokens", len(blocks), args.seq_len)
    results: dict = {"split": {"corpus": str(args.corpus), "val_fraction": args.val_fraction,
                               "max_tokens": args.max_tokens, "seq_len": args.seq_len, "blocks": len(blocks)}}
    if (model.config.metadata or {}).get("dense_baseline"):  # a dense baseline alone: its CE, no prototype metrics
        if args.dense:
            raise ValueError("--checkpoint is a dense baseline (prism.train --dense-baseline); --dense compares a "
                             "PRISM checkpoint with one")
        results["dense"] = {"checkpoint": str(checkpoint),
                            **evaluate_lm(lambda ids: model.lm_head(model.final_states(ids)[0]), blocks,
                                          args.batch_size, "dense")}
    else:
        results["prism"] = {"checkpoint": str(checkpoint), **evaluate_prism(model, blocks, args.batch_size)}
    if args.dense:
        dense = PrismForCausalLM.from_pretrained(args.dense).eval()
        results["dense"] = {"checkpoint": str(args.dense),
                            **evaluate_lm(lambda ids: dense.lm_head(dense.final_states(ids)[0]), blocks,
                                          args.batch_size, "dense")}
        del dense
    backbone_spec = args.backbone or model.config.backbone
    if backbone_spec and not args.no_backbone:
        backbone = load_backbone(backbone_spec)
        results["backbone"] = {"backbone": backbone_spec,
                               **evaluate_lm(lambda ids: backbone(ids).logits, blocks, args.batch_size, "backbone")}
    if "dense" in results and "prism" in results:
        results["prism_vs_dense_ce"] = results["prism"]["ce"] / results["dense"]["ce"] - 1
    return results


def format_table(results: dict) -> str:
    rows = [f"{'model':<10} {'CE':>8} {'ppl':>10}"]
    for name in ("prism", "dense", "backbone"):
        if name in results:
            rows.append(f"{name:<10} {results[name]['ce']:>8.4f} {results[name]['perplexity']:>10.3f}")
    if "prism" not in results:
        return "\n".join(rows)
    p = results["prism"]
    rows.append(f"prism: fve {p['fve']:.4f}  r1_bar {p['r1_bar']:.4f}  r2 {p['r2']:.4f}  "
                f"mean_active {p['mean_active']:.2f}/{p['top_k']}  dead {p['dead_fraction']:.4f}")
    if "prism_vs_dense_ce" in results:
        rows.append(f"prism CE vs dense: {100 * results['prism_vs_dense_ce']:+.2f}%")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("python -m prism.eval", __doc__)
    parser.add_argument("--checkpoint", required=True,
                        help="PRISM checkpoint folder (save_pretrained); a dense baseline's is scored on its own")
    parser.add_argument("--dense", help="dense baseline checkpoint folder (prism.train --dense-baseline)")
    parser.add_argument("--backbone", help="untouched backbone to compare (default: the checkpoint's)")
    parser.add_argument("--no-backbone", action="store_true", help="skip the untouched backbone")
    parser.add_argument("--corpus", help="default: the training run's corpus")
    parser.add_argument("--val-fraction", type=float, help="default: the training run's")
    parser.add_argument("--max-tokens", type=int, help="default: the training run's")
    parser.add_argument("--seq-len", type=int, help="default: the training run's")
    parser.add_argument("--max-val-tokens", type=int, help="evaluate on at most this many held-out tokens")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", help="JSON file to write the results to (default: none, the table is printed; "
                                      "nothing is ever written into the checkpoint folder unless --out names it)")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = cli.parse(parser, argv)
    with cli.expected_errors(parser, ValueError, FileNotFoundError):
        results = run(args)
    print(format_table(results))  # noqa: T201 - the command's output
    if args.out:  # only where asked: evaluating a shipped model must not change its folder
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
        logger.info("wrote %s", out)
    return results


if __name__ == "__main__":
    main()
