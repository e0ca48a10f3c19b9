"""Training throughput of PRISM vs its dense baseline, measured side by side in one process.

    python -m bench.train_throughput --backbone smollm2 --corpus data.jsonl --n-layers 2 --n-prototypes 1024

Both models train the same top layers (top mode, cached lower states) on the same batches; steps alternate
PRISM, dense, PRISM, dense, ... so machine noise hits both alike. Prints one JSON line with the median seconds per
step of each, tokens/s, and the ratio PRISM/dense of tokens/s (the paper: 97.3% of dense throughput).

    python -m bench.train_throughput ... --autocast-compare      # float32 vs --autocast bfloat16, side by side

With --autocast-compare, bfloat16 copies of both models (prism.train --autocast bfloat16: products in bfloat16,
weights and losses in float32) take steps in the same rotation, and the lower layers' forward that fills the
hidden-state cache is timed both ways too; the line gains the speed-up of each (float32 time / bfloat16 time).

Training keeps freed memory in the process (prism/memory.py) and so does this benchmark, so it measures what
prism.train does; --release-freed-memory measures glibc's default instead. Every result records the machine it ran
on (CPU model, vector extensions, torch's kernel level and threads, native bfloat16, the allocator): ratios from
different machines are different rows, never one number.
"""

from __future__ import annotations

import copy
import logging
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from prism import PrismConfig, PrismForCausalLM, cli
from prism.backbones import load_backbone, load_tokenizer
from prism.data import pack, tokenize_split
from prism.memory import allocator, keep_freed_memory
from prism.train import (
    TrainArgs,
    TrainModule,
    _set_trainable,
    autocast,
    bfloat16_speedup,
    init_prototypes,
    native_bfloat16,
)

# the vector extensions that decide which CPU kernels run (matrix products, bfloat16)
EXTENSIONS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8",
              "avx_vnni", "asimd", "sve", "bf16")

logger = logging.getLogger("bench.train_throughput")


def machine() -> dict:
    """What a throughput number depends on: the CPU, its vector extensions, torch's kernel level and threads,
    whether bfloat16 is native, and the allocator."""
    info: dict[str, str] = {}
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text(errors="replace").splitlines() if cpuinfo.exists() else []:
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())  # the first processor's
    cpu = info.get("model name") or info.get("Model") or platform.processor() or platform.machine()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    return {"cpu": cpu, "arch": platform.machine(), "extensions": [e for e in EXTENSIONS if e in flags],
            "torch_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "native_bfloat16": native_bfloat16(), "allocator": allocator(), "torch": torch.__version__,
            # what --autocast auto decides by (prism.train.fast_bfloat16): native is not always faster
            "bfloat16_speedup": round(bfloat16_speedup(), 3) if native_bfloat16() else None}


def page_faults() -> int:
    """Minor page faults of this process so far (first touches of fresh pages; 0 where getrusage is missing)."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def profile_steps(module, optimizer, batches, top: int) -> list[dict]:
    """torch.profiler over whole training steps: the `top` operators by self CPU time, per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for ids, states in batches:
            loss, _, _ = module(ids, states)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    table = prof.key_averages()
    sys.stderr.write(table.table(sort_by="self_cpu_time_total", row_limit=top) + "\n")
    rows = sorted(table, key=lambda e: -e.self_cpu_time_total)[:top]
    return [{"op": e.key, "self_ms_per_step": round(e.self_cpu_time_total / 1000 / len(batches), 2),
             "calls_per_step": e.count // len(batches)} for e in rows]


def main(argv: list[str] | None = None) -> dict:
    parser = cli.parser("python -m bench.train_throughput", __doc__, formatter="plain")
    parser.add_argument("--backbone", default="smollm2")
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--n-prototypes", type=int, default=1024)
    parser.add_argument("--top-k", type=int, default=8)
    for name in ("lambda_path_ce", "lambda_path_kl", "lambda_head_rec"):  # the prototype-path terms (prism.train)
        parser.add_argument("--" + name.replace("_", "-"), type=float, default=0.0,
                            help=f"PRISM's {name} (default 0: the paper's objective)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per model (after 2 warm-up steps)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after timing, profile 2 steps of each model and report the N operators with the "
                             "most self CPU time (the table also goes to stderr)")
    parser.add_argument("--autocast-compare", action="store_true",
                        help="also time bfloat16 mixed precision (--autocast bfloat16) against float32: PRISM and "
                             "dense steps, and the lower layers' forward that fills the cache; skipped, with a "
                             "line saying so, on a CPU that emulates bfloat16 (no AVX-512 BF16 or AMX)")
    parser.add_argument("--force-bfloat16", action="store_true",
                        help="with --autocast-compare, time bfloat16 even where it is emulated (tens of times "
                             "slower than float32 there: an hour for the 24-repeat run)")
    parser.add_argument("--release-freed-memory", action="store_true",
                        help="leave glibc returning large freed buffers to the kernel (prism.train's flag of the "
                             "same name): measures the allocator's default instead of what training does")
    args = cli.parse(parser, argv)
    path_terms = {name: getattr(args, name) for name in ("lambda_path_ce", "lambda_path_kl", "lambda_head_rec")}
    with cli.expected_errors(parser, ValueError):  # bad sizes or weights, before anything loads
        PrismConfig(n_prototypes=args.n_prototypes, top_k=args.top_k, **path_terms)
    emulated = ""
    if args.autocast_compare and not args.force_bfloat16 and not native_bfloat16():
        emulated = (f"bfloat16 not timed: this CPU ({torch.backends.cpu.get_cpu_capability()}) emulates bfloat16 "
                    "products, tens of times slower than float32, so training here runs in float32 "
                    "(--autocast auto); --force-bfloat16 times it anyway")
        logger.warning(emulated)
        args.autocast_compare = False
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.release_freed_memory:
        keep_freed_memory()

    tokenizer = load_tokenizer(args.backbone)
    n_blocks = args.batch_size * (args.repeats + 2)
    stream = tokenize_split(args.corpus, tokenizer, 0.0, max_tokens=n_blocks * args.seq_len + 1)["train"]
    blocks = pack(stream, args.seq_len)[:n_blocks]
    backbone = load_backbone(args.backbone)
    cfg = PrismConfig(n_prototypes=args.n_prototypes, top_k=args.top_k, backbone=args.backbone, **path_terms)
    prism = PrismForCausalLM.from_backbone(backbone, cfg).eval()
    dense = copy.deepcopy(prism)
    start = prism.n_layers - args.n_layers
    batches = []
    for lo in range(0, len(blocks), args.batch_size):
        ids = torch.from_numpy(blocks[lo: lo + args.batch_size].astype(np.int64))
        batches.append((ids, prism.states_before_layer(ids, start)))
    states = []  # real final states, as prism.train seeds the bank: as many batches as K needs (twice K tokens)
    with torch.no_grad():
        for ids, before in batches:
            z, _ = prism.final_states(ids, start_layer=start, start_states=before)
            states.append(z.reshape(-1, z.shape[-1]))
            if sum(len(s) for s in states) >= 2 * args.n_prototypes:
                break
    with cli.expected_errors(parser, ValueError):  # more prototypes than the timed batches have distinct states
        init_prototypes(prism, torch.cat(states), seed=0)

    models = {"prism": prism, "dense": dense}
    if args.autocast_compare:
        models.update({"prism_bf16": copy.deepcopy(prism), "dense_bf16": copy.deepcopy(dense)})
    modules, optimizers = {}, {}
    for name, model in models.items():
        targs = TrainArgs(corpus=args.corpus, out="-", mode="top", n_layers=args.n_layers,
                          n_prototypes=args.n_prototypes, top_k=args.top_k, dense_baseline=name.startswith("dense"),
                          **path_terms,
                          autocast="bfloat16" if name.endswith("_bf16") else "none")
        _set_trainable(model, targs)
        modules[name] = TrainModule(model, targs)
        optimizers[name] = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    names = list(models)
    times: dict[str, list[float]] = {name: [] for name in names}
    faults: dict[str, list[int]] = {name: [] for name in names}  # pages touched for the first time, per step
    for step, (ids, states) in enumerate(batches):
        for name in names[step % len(names):] + names[:step % len(names)]:  # rotate who goes first
            f0, t0 = page_faults(), time.perf_counter()
            loss, _, _ = modules[name](ids, states)
            optimizers[name].zero_grad(set_to_none=True)
            loss.backward()
            optimizers[name].step()
            if step >= 2:
                times[name].append(time.perf_counter() - t0)
                faults[name].append(page_faults() - f0)
    if args.profile:
        profiles = {name: profile_steps(modules[name], optimizers[name], batches[:2], args.profile)
                    for name in ("dense", "prism", "dense", "prism")}  # twice, alternating: the second counts
        if args.autocast_compare:
            profiles.update({name: profile_steps(modules[name], optimizers[name], batches[:2], args.profile)
                             for name in ("dense_bf16", "prism_bf16", "dense_bf16", "prism_bf16")})
    tokens = args.batch_size * args.seq_len
    med = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "backbone": args.backbone, "n_layers": args.n_layers, "n_prototypes": args.n_prototypes,
        "top_k": args.top_k, **path_terms, "tokens_per_step": tokens, "repeats": args.repeats,
        "machine": machine(), "precision": "float32",
        "prism_s_per_step": med["prism"], "dense_s_per_step": med["dense"],
        "prism_tokens_per_s": tokens / med["prism"], "dense_tokens_per_s": tokens / med["dense"],
        "throughput_ratio": med["dense"] / med["prism"],
        "ratio_per_pair_median": statistics.median(d / p for p, d in zip(times["prism"], times["dense"])),
        # every step's seconds and minor page faults, in order: slow steps that fault many fresh pages are the
        # allocator's doing, not the model's
        "steps": {name: {"s": [round(t, 4) for t in times[name]], "page_faults": faults[name]} for name in names},
    }
    if args.autocast_compare:
        fill = {"none": [], "bfloat16": []}
        bf16_args = TrainArgs(corpus=args.corpus, out="-", autocast="bfloat16")
        for step, (ids, _) in enumerate(batches):
            for kind in ("none", "bfloat16") if step % 2 == 0 else ("bfloat16", "none"):
                t0 = time.perf_counter()
                if kind == "none":
                    prism.states_before_layer(ids, start)
                else:
                    with autocast(bf16_args):
                        prism.states_before_layer(ids, start)
                if step >= 2:
                    fill[kind].append(time.perf_counter() - t0)
        fill_med = {k: statistics.median(v) for k, v in fill.items()}
        result["autocast"] = {
            "prism_bf16_s_per_step": med["prism_bf16"], "dense_bf16_s_per_step": med["dense_bf16"],
            "prism_speedup": med["prism"] / med["prism_bf16"], "dense_speedup": med["dense"] / med["dense_bf16"],
            "throughput_ratio_bf16": med["dense_bf16"] / med["prism_bf16"],
            "cache_fill_s_per_batch": fill_med["none"], "cache_fill_bf16_s_per_batch": fill_med["bfloat16"],
            "cache_fill_speedup": fill_med["none"] / fill_med["bfloat16"],
        }
    if emulated:
        result["autocast"] = {"skipped": emulated}
    if args.profile:
        result["profile"] = profiles
    cli.print_json(result)
    return result


if __name__ == "__main__":
    main()
