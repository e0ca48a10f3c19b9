"""Evaluate a PRISM checkpoint on held-out text, beside its dense baseline and the untouched backbone.

    python -m prism.eval --checkpoint runs/prism/final --dense runs/dense/final --out eval.json

Prints a table and writes JSON with, per model, validation cross-entropy and perplexity, and for PRISM the
prototype metrics of docs/DESIGN.md section 2 over the held-out tokens:
- fve:           fraction of the variance of z explained by z_hat, 1 - sum ||r||^2 / sum ||z - mean z||^2
- r1_bar:        mean over prototypes of max over tokens of cos(p_i, z_t)  (prototypes sit on data)
- r2:            mean over tokens of max over prototypes of cos(z_t, p_i)  (tokens are covered)
- mean_active:   mean number of prototypes with activation > 0 per token (at most top_k)
- dead_fraction: fraction of prototypes never active on the held-out tokens
and what the prototypes carry of each prediction (prism/explain.py), under "path": the prototype path W z_hat + b's
top-1 agreement with the full model, its cross-entropy beside the full model's, KL(full || path), and the margin
share of the top-1 over the top-2 token (median, and the fraction of positions where it is >= 0.5). The same path
measures are given per source ("sources": each source's own held-out documents, up to --per-source-tokens tokens a
source, so a source that comes late in the corpus is not left out) and on the modern-English probe (prism/probe.py,
"probe": each passage its own sequence, per kind and overall; --no-probe skips it).
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
from prism.corpora import local_corpus
from prism.data import is_validation, pack, read_documents, tokenize_split
from prism.explain import PathStatistics, path_statistics, summarize_path
from prism.losses import IGNORE_INDEX, ce_loss
from prism.probe import PROBE
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


def next_token_labels(ids: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, T): the token each position predicts, IGNORE_INDEX at the last position."""
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = ids[:, 1:]
    return labels


def _path(model: PrismForCausalLM, out, ids: torch.Tensor) -> PathStatistics:
    return path_statistics(out.z, out.z_hat, model.lm_head.weight, model.lm_head.bias, next_token_labels(ids))


@torch.no_grad()
def path_parts(model: PrismForCausalLM, sequences: list[np.ndarray], batch_size: int, desc: str,
               ) -> list[PathStatistics]:
    """The per-position path measures of each batch of sequences of token ids: blocks of one length are batched,
    sequences of other lengths run one at a time (so a part is one sequence)."""
    parts = []
    step = batch_size if len({len(s) for s in sequences}) == 1 else 1
    for lo in tqdm(range(0, len(sequences), step), desc=desc, unit="batch", leave=False):
        ids = torch.from_numpy(np.stack(sequences[lo: lo + step]).astype(np.int64))  # (b, T)
        parts.append(_path(model, model(ids), ids))
    return parts


def _summary(parts: list[PathStatistics]) -> dict:
    stats = parts[0]
    for part in parts[1:]:
        stats = stats.cat(part)
    return summarize_path(stats)


def evaluate_path(model: PrismForCausalLM, sequences: list[np.ndarray], batch_size: int, desc: str) -> dict:
    """The path measures (prism.explain.summarize_path) over sequences of token ids."""
    return _summary(path_parts(model, sequences, batch_size, desc))


@torch.no_grad()
def evaluate_prism(model: PrismForCausalLM, blocks: np.ndarray, batch_size: int) -> dict[str, float]:
    """CE and perplexity plus the prototype and path metrics (module docstring) over blocks (N, T)."""
    n_protos = model.config.n_prototypes
    best = torch.full((n_protos,), -1.0)  # max over tokens of cos(p_i, z_t)
    used = torch.zeros(n_protos, dtype=torch.bool)
    sums = dict(ce=0.0, r2=0.0, active=0.0, rec=0.0, resid_sq=0.0)
    z_sum, z_sq, n_tok, n_pred = None, 0.0, 0, 0
    path = None
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
        part = _path(model, out, ids)
        path = part if path is None else path.cat(part)
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
        "path": summarize_path(path),
    }


def source_blocks(corpus: str, tokenizer, val_fraction: float, seq_len: int, tokens_per_source: int,
                  ) -> dict[str, np.ndarray]:
    """Held-out blocks (N, seq_len) per source: each source's validation documents (the training split's
    is_validation) in corpus order, up to tokens_per_source tokens a source; sources without one block are left
    out."""
    eos = tokenizer.eos_token_id
    streams: dict[str, list[int]] = {}
    for doc in read_documents(corpus):
        if not is_validation(doc.doc_id, val_fraction):
            continue
        stream = streams.setdefault(doc.source, [])
        if len(stream) < tokens_per_source:
            stream.extend(tokenizer(doc.text, add_special_tokens=False)["input_ids"] + [eos])
    blocks = {src: pack(np.asarray(s[:tokens_per_source], dtype=np.int32), seq_len) for src, s in streams.items()}
    return {src: b for src, b in sorted(blocks.items()) if len(b)}


def probe_sequences(tokenizer, max_length: int | None = None) -> list[tuple[str, np.ndarray]]:
    """(kind, ids) per probe passage, each after the end-of-text token, as a training document starts; cut to
    max_length tokens where the model has a context limit."""
    eos = tokenizer.eos_token_id
    return [(p["kind"], np.asarray([eos] + tokenizer(p["text"], add_special_tokens=False)["input_ids"])[:max_length])
            for p in PROBE]


def probe_in_corpus(corpus: str) -> int:
    """How many probe passages occur (their first 60 characters) in any document of the corpus."""
    heads = [p["text"][:60] for p in PROBE]
    found = set()
    for doc in read_documents(corpus):
        found.update(i for i, h in enumerate(heads) if h in doc.text)
    return len(found)


def evaluate_probe(model: PrismForCausalLM, tokenizer, corpus: str | None) -> dict:
    """The path measures on the probe, overall and per kind, and how many passages the corpus holds."""
    seqs = probe_sequences(tokenizer, model.max_length)
    parts = path_parts(model, [s for _, s in seqs], 1, "probe")  # one part per passage
    result = {"passages": len(seqs), **_summary(parts)}
    for kind in dict.fromkeys(k for k, _ in seqs):
        result[kind] = _summary([part for (k, _), part in zip(seqs, parts) if k == kind])
    if corpus is not None:
        result["in_corpus"] = probe_in_corpus(corpus)
    return result


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
    cache = (saved.get("cache_dir") if train_args_file.exists() else None) or checkpoint.parent / "cache"
    args.corpus = local_corpus(args.corpus, cache)  # a named corpus: the file the training run exported it to
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
        if args.per_source_tokens:
            per_source = source_blocks(args.corpus, tokenizer, args.val_fraction, args.seq_len,
                                       args.per_source_tokens)
            results["prism"]["sources"] = {src: {"tokens": int(b.size), **evaluate_path(model, list(b),
                                                                                        args.batch_size, src)}
                                           for src, b in per_source.items()}
        if not args.no_probe:
            results["prism"]["probe"] = evaluate_probe(model, tokenizer, args.corpus)
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
    rows.append(f"{'prototype path':<18} {'agree':>6} {'share':>6} {'>=0.5':>6} {'path CE':>8} {'CE':>7} "
                f"{'KL':>6}")
    paths = {"held-out": p["path"], **{f"  {s}": v for s, v in p.get("sources", {}).items()}}
    if "probe" in p:
        paths["probe"] = p["probe"]
        paths.update({f"  probe {k}": p["probe"][k] for k in ("everyday", "technical", "news", "code")
                      if k in p["probe"]})
    for name, v in paths.items():
        rows.append(f"{name:<18} {v['agreement']:>6.3f} {v['margin_share_median']:>6.3f} {v['carried_fraction']:>6.3f} "
                    f"{v['path_ce']:>8.3f} {v['full_ce']:>7.3f} {v['kl']:>6.3f}")
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
    parser.add_argument("--per-source-tokens", type=int, default=8192,
                        help="path measures per source on up to this many held-out tokens a source (0: skip)")
    parser.add_argument("--no-probe", action="store_true",
                        help="skip the modern-English probe passages (prism/probe.py)")
    parser.add_argument("--batch-size", type=int, default=8, help="held-out sequences per forward pass")
    parser.add_argument("--out", help="JSON file to write the results to (default: none, the table is printed; "
                                      "nothing is ever written into the checkpoint folder unless --out names it)")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = cli.parse(parser, argv)
    if args.per_source_tokens < 0:
        cli.fail(parser, f"--per-source-tokens must be >= 0, got {args.per_source_tokens}")
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
