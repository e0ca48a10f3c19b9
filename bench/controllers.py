"""The controller experiment: prototype controllers against a dense baseline with as many parameters, fitted per
task and seed on multiple-choice items built from held-out documents, scored exactly on the test items.

    python -m bench.controller_tasks build --checkpoint runs/prism/final --out runs/prism/tasks   # the items
    python -m bench.controllers fit --checkpoint runs/prism/final --tasks runs/prism/tasks --out runs/prism/ctl
    python -m bench.controllers eval --out runs/prism/ctl          # per-task accuracies as JSON
    python -m bench.controller_tasks describe --controllers runs/prism/ctl --db out.duckdb        # what moved

fit: per task, every item is encoded through the model once (cached under OUT/cache, keyed by the bank, the items
and the arguments), then for every kind (prototype: prism/controllers.py; dense: bench/dense_controller.py) and
seed the fit of prism/controller_fit.py tries every --l1 strength and keeps the best on validation. The fit's
arguments are stored in OUT/fit_args.json; other arguments into the same folder are refused unless --overwrite.
Seeds change the item order (and the baseline's frame).

eval: exact test accuracy through model.head with Interventions (the prototype controller) or lm_head of the
edited z (the baseline), the mean and spread over seeds and, per seed, the items fixed and broken against the
plain model on the same items (a paired standard error); the prototypes the seeds moved most; what a controller
costs at inference (its parameters, multiply-adds per token beside the LM head's, and measured head and
generation times with and without it).

On a CPU that another job keeps busy, OMP_NUM_THREADS=1 avoids threads waiting on each other.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import statistics
import time
from collections import Counter
from dataclasses import asdict, fields
from pathlib import Path

import torch

from bench.dense_controller import DENSE, DenseController, load_any
from prism import cli
from prism.controller_fit import (
    PROTOTYPE,
    REDUCTIONS,
    EncodedItems,
    FitArgs,
    candidate_features,
    correct,
    encode_items,
    exact_logprobs,
    fit_best,
    option_scores,
    read_items,
    tokenize_items,
)
from prism.controllers import PrototypeController, bank_fingerprint, save_controller
from prism.model import Interventions, PrismForCausalLM

logger = logging.getLogger(__name__)

KINDS = {kind.name: kind for kind in (PROTOTYPE, DENSE)}
FIT_ARGS = "fit_args.json"
FIT_SUMMARY = "fit.json"
EVAL_RESULTS = "eval.json"
CACHE_DIR = "cache"
COST_PROMPT = "The history of the river begins"  # what eval times generation on


# ----------------------------------------------------------------------------------------------------------------
# Exact evaluation and cost.


@torch.no_grad()
def correct_items(model: PrismForCausalLM, enc: EncodedItems, controller: PrototypeController | DenseController | None,
                 reduce: str = "mean") -> torch.Tensor:
    """(n_items,) bool, exact: the prototype controller through Interventions (model.head), the baseline through
    lm_head of its edited z, None for the plain model."""
    if isinstance(controller, DenseController):
        logprobs = exact_logprobs(model, enc, z_edit=controller.edit)
    else:
        logprobs = exact_logprobs(model, enc, None if controller is None else Interventions(controller=controller))
    return correct(option_scores(logprobs, enc, reduce), enc.answers)


def paired(after: torch.Tensor, before: torch.Tensor) -> dict:
    """Accuracy after, and the change against before on the same items: items fixed and broken, and the standard
    error of the gain in points (paired: only items that flip count)."""
    diff = after.double() - before.double()  # (n,) in {-1, 0, 1}
    n = diff.shape[0]
    se = float(diff.std(unbiased=True) / math.sqrt(n)) if n > 1 else float("nan")
    return {"accuracy": float(after.double().mean()), "fixed": int((after & ~before).sum()),
            "broken": int((~after & before).sum()), "gain_points": 100 * float(diff.mean()),
            "gain_se_points": 100 * se}


@torch.no_grad()
def inference_cost(model: PrismForCausalLM, controller: PrototypeController, z: torch.Tensor,
                   prompt_ids: torch.Tensor | None = None, new_tokens: int = 16, repeats: int = 5) -> dict:
    """What the controller adds at inference: its parameters, the multiply-adds it needs per token beside the LM
    head's, and measured times with and without it (median of `repeats`): the head on states z (T, d), and
    cached greedy generation of new_tokens after prompt_ids (1, T) when given."""
    d, vocab, k = model.d_model, model.vocab_size, model.config.top_k
    iv = Interventions(controller=controller)

    def median_time(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    head = {name: median_time(lambda iv=value: model.head(z[None], iv)) / z.shape[0] * 1e3
            for name, value in (("plain", None), ("controller", iv))}
    cost = {"parameters": controller.n_parameters, "nonzero_parameters": len(controller.moved()),
            # k factors times k activations, then the change of z: k rows of d (the LM head itself: V x d)
            "extra_macs_per_token": k + k * d, "lm_head_macs_per_token": vocab * d,
            "head_ms_per_token": head, "head_overhead": head["controller"] / head["plain"] - 1,
            "tokens_timed": int(z.shape[0])}
    if prompt_ids is not None:
        gen = {name: new_tokens / median_time(lambda iv=value: model.generate(prompt_ids, new_tokens,
                                                                               interventions=iv))
               for name, value in (("plain", None), ("controller", iv))}
        cost["generate_tokens_per_s"] = gen
    return cost


# ----------------------------------------------------------------------------------------------------------------
# The command line: fit and eval.


def _tokenizer_for(checkpoint: Path, model: PrismForCausalLM):
    from prism.backbones import load_tokenizer

    source = checkpoint if (checkpoint / "tokenizer_config.json").exists() else model.config.backbone
    if source is None:
        raise ValueError(f"{checkpoint} has no tokenizer and its config names no backbone to take one from")
    return load_tokenizer(str(source))


def task_files(spec: list[str]) -> dict[str, Path]:
    """{task name: items file} from files or folders of *.jsonl (bench.controller_tasks build writes them)."""
    files: list[Path] = []
    for s in spec:
        path = Path(s)
        files += sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no task files (*.jsonl) in {' '.join(spec)}")
    out = {}
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"no task file {f}")
        tasks = {it.task for it in read_items(f)}
        if len(tasks) != 1:
            raise ValueError(f"{f} mixes tasks {sorted(tasks)}: one task per file")
        out[tasks.pop()] = f
    return out


def encoded_task(model: PrismForCausalLM, tokenizer, task: str, items_file: Path, out: Path,
                 max_context_tokens: int, max_items: int | None) -> EncodedItems:
    """Every item of a task run through the backbone once, cached under OUT/cache (keyed by model, items, args)."""
    items = read_items(items_file)
    if max_items is not None:  # the first max_items of each split: smoke runs
        seen: Counter[str] = Counter()
        kept = []
        for it in items:
            if seen[it.split] < max_items:
                kept.append(it)
                seen[it.split] += 1
        items = kept
    key = {"bank": bank_fingerprint(model), "items": hashlib.sha256(items_file.read_bytes()).hexdigest(),
           "max_context_tokens": max_context_tokens, "max_items": max_items, "vocab": len(tokenizer)}
    path = out / CACHE_DIR / f"{task}.safetensors"
    if path.is_file():
        enc, stored = EncodedItems.load(path)
        if stored == key:
            logger.info("%s: %d encoded items from %s", task, enc.n_items, path)
            return enc
    enc = encode_items(model, tokenize_items(items, tokenizer, max_context_tokens), [it.split for it in items],
                       desc=f"encoding {task}")
    enc.save(path, key)
    return enc


def _split_counts(enc: EncodedItems) -> dict[str, int]:
    return {s: enc.splits.count(s) for s in ("fit", "val", "test")}


def run_fit(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    fit_args = FitArgs(**{f.name: getattr(args, f.name) for f in fields(FitArgs)})
    stored = {"checkpoint": str(args.checkpoint), "tasks": [str(t) for t in args.tasks], "kinds": list(args.kinds),
              "seeds": list(args.seeds), "max_context_tokens": args.max_context_tokens, "max_items": args.max_items,
              "fit": asdict(fit_args)}
    args_file = out / FIT_ARGS
    if args_file.is_file() and not args.overwrite:
        previous = json.loads(args_file.read_text())
        if previous != json.loads(json.dumps(stored)):
            raise ValueError(f"{out} holds controllers fitted with other arguments ({args_file}); use --overwrite "
                             "or another --out")
    out.mkdir(parents=True, exist_ok=True)
    args_file.write_text(json.dumps(stored, indent=2))
    checkpoint = Path(args.checkpoint)
    model = PrismForCausalLM.from_pretrained(checkpoint).eval()
    model.requires_grad_(False)
    tokenizer = _tokenizer_for(checkpoint, model)
    summary: dict = {}
    for task, items_file in task_files(args.tasks).items():
        enc = encoded_task(model, tokenizer, task, items_file, out, args.max_context_tokens, args.max_items)
        feats = {s: candidate_features(model, enc.subset(s), fit_args.candidates) for s in ("fit", "val")}
        summary[task] = {"items": _split_counts(enc), "controllers": {}}
        for kind in args.kinds:
            for seed in args.seeds:
                path = out / task / f"{kind}-seed{seed}.safetensors"
                if path.is_file() and not args.overwrite:
                    logger.info("%s exists, kept", path)
                    controller = load_any(path, model)
                    result_meta = controller.meta
                else:
                    result = fit_best(KINDS[kind], model, feats["fit"], feats["val"], fit_args, seed,
                                      meta={"task": task, "items_file": str(items_file)})
                    save_controller(result.controller, path)
                    result_meta = {**result.controller.meta, "history": result.history}
                summary[task]["controllers"][path.name] = {
                    k: result_meta.get(k) for k in ("seed", "l1", "epoch", "val_accuracy", "val_accuracy_before",
                                                    "history")} | {"moved": len(load_any(path).moved())}
    (out / FIT_SUMMARY).write_text(json.dumps(summary, indent=2))
    return summary


def _spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "per_seed": values}


def run_eval(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    args_file = out / FIT_ARGS
    if not args_file.is_file():
        raise FileNotFoundError(f"{out} has no {FIT_ARGS}: run `python -m bench.controllers fit` first")
    stored = json.loads(args_file.read_text())
    checkpoint = Path(args.checkpoint or stored["checkpoint"])
    model = PrismForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = _tokenizer_for(checkpoint, model)
    reduce = stored["fit"]["reduce"]
    results: dict = {"checkpoint": str(checkpoint), "score": reduce, "tasks": {}}
    for task, items_file in task_files(stored["tasks"]).items():
        enc = encoded_task(model, tokenizer, task, items_file, out, stored["max_context_tokens"],
                           stored["max_items"])
        test = enc.subset("test")
        before = correct_items(model, test, None, reduce)
        row: dict = {"items": _split_counts(enc), "before": float(before.double().mean())}
        per_kind: dict[str, list] = {k: [] for k in KINDS}
        for path in sorted((out / task).glob("*.safetensors")):
            controller = load_any(path, model)
            per_kind[controller.kind].append((controller, paired(correct_items(model, test, controller, reduce),
                                                                 before)))
        for kind, fitted in per_kind.items():
            if not fitted:
                continue
            row[kind] = {**_spread([r["accuracy"] for _, r in fitted]),
                         "gain_points": statistics.fmean(r["gain_points"] for _, r in fitted),
                         "per_seed_paired": [r for _, r in fitted], "moved": [len(c.moved()) for c, _ in fitted],
                         "seeds": [c.meta.get("seed") for c, _ in fitted],
                         "l1": [c.meta.get("l1") for c, _ in fitted]}
        protos = [c for c, _ in per_kind["prototype"]]
        if protos:
            row["top_prototypes"] = top_moved(protos, args.top)
            prompt = torch.tensor([tokenizer(COST_PROMPT, add_special_tokens=False)["input_ids"]])
            row["cost"] = inference_cost(model, protos[0], test.z[: args.cost_tokens], prompt, repeats=3)
        results["tasks"][task] = row
    results["mean_gain_points"] = {kind: statistics.fmean(r[kind]["gain_points"] for r in results["tasks"].values()
                                                          if kind in r)
                                   for kind in KINDS if any(kind in r for r in results["tasks"].values())}
    results["summary"] = {task: {"before": r["before"], **{kind: f"{100 * r[kind]['mean']:.2f} +- "
                                                             f"{100 * r[kind]['std']:.2f}" for kind in KINDS
                                                             if kind in r}}
                          for task, r in results["tasks"].items()}
    (out / EVAL_RESULTS).write_text(json.dumps(results, indent=2))
    return results


def top_moved(controllers: list[PrototypeController], n: int) -> dict[str, list[dict]]:
    """The prototypes the seeds' controllers moved most, by mean log-factor: raised and lowered, with the factor
    per seed and how many seeds moved each."""
    g = torch.stack([c.log_factors for c in controllers])  # (S, K)
    mean = g.mean(0)
    order = mean.argsort(descending=True).tolist()

    def rows(ids):
        return [{"prototype_id": int(i), "mean_factor": float(mean[i].exp()),
                 "factors": [float(v) for v in g[:, i].exp()], "seeds_moving": int((g[:, i] != 0).sum())}
                for i in ids]

    return {"raised": rows([i for i in order if mean[i] > 0][:n]),
            "lowered": rows([i for i in reversed(order) if mean[i] < 0][:n])}


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("python -m bench.controllers", __doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    fit = cli.subparser(commands, "fit", help="fit prototype controllers and the dense baseline per task and seed")
    fit.add_argument("--checkpoint", required=True, help="PRISM checkpoint folder (save_pretrained)")
    fit.add_argument("--tasks", required=True, nargs="+", help="task files (*.jsonl) or folders of them "
                                                                 "(python -m bench.controller_tasks build)")
    fit.add_argument("--out", required=True, help="folder for controllers, caches and fit.json")
    fit.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS), help="what to fit")
    fit.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="one fit per seed (item order; the "
                                                                              "baseline's frame)")
    fit.add_argument("--max-context-tokens", type=int, default=128, help="context tokens kept before the options")
    fit.add_argument("--max-items", type=int, default=None, help="only the first N items of each split (smoke runs)")
    fit.add_argument("--overwrite", action="store_true", help="refit, replacing controllers in --out")
    defaults = FitArgs()
    helps = {"epochs": "passes over the fit items (the best epoch on validation is kept, the identity included)",
             "lr": "Adam step size on g = log(factor)", "batch_size": "items per step",
             "l1": "soft-threshold strengths to try, one fit each (validation picks); in (0, 1): dense to empty",
             "max_moved": "top-m: at most this many prototypes (baseline: frame directions) move",
             "max_factor": "factors stay in [1/max_factor, max_factor]",
             "temperature": "option scores / temperature -> softmax over the options",
             "reduce": "option score: mean or sum of its token log-probabilities",
             "candidates": "tokens per position in the fit's softmax beside the target (the rest: one term)"}
    group = fit.add_argument_group("optimisation")
    for f in fields(FitArgs):
        default = getattr(defaults, f.name)
        flag = "--" + f.name.replace("_", "-")
        if f.name == "l1":
            group.add_argument(flag, type=float, nargs="+", default=list(default), help=helps[f.name])
        elif f.name == "max_moved":
            group.add_argument(flag, type=int, default=None, help=helps[f.name])
        elif f.name == "reduce":
            group.add_argument(flag, choices=REDUCTIONS, default=default, help=helps[f.name])
        else:
            group.add_argument(flag, type=type(default), default=default, help=helps[f.name])
    ev = cli.subparser(commands, "eval", help="exact test accuracy before/after each controller; prints JSON")
    ev.add_argument("--out", required=True, help="the folder `fit` wrote")
    ev.add_argument("--checkpoint", help="default: the one fit used")
    ev.add_argument("--top", type=int, default=10, help="moved prototypes to list per direction")
    ev.add_argument("--cost-tokens", type=int, default=512, help="test positions to time the head on")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = cli.parse(parser, argv)
    logger.info("arguments: %s", json.dumps(vars(args)))
    with cli.expected_errors(parser, ValueError, FileNotFoundError):
        result = run_fit(args) if args.command == "fit" else run_eval(args)
    if args.command == "eval":
        cli.print_json(result, indent=2)  # the command's output
    return result


if __name__ == "__main__":
    main()
