"""The attribution job's gradient store (pass 5 in precompute/attribution/__init__.py): the projections over the
trained layers the fit pass uses, and the store written from its token files (prism/grad_cache.py has the math;
cache.load_gradient_store reads it back).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from precompute.attribution.cache import GRADIENT_FORMAT
from precompute.runs import NO_HOOKS, JobHooks, replacing_folder
from prism.grad_cache import GradientCache, summed_gradients, trained_start_layer

logger = logging.getLogger("precompute.attribution")


def gradient_cache_for(model, args) -> GradientCache | None:
    """The gradient store's projections (rank args.grad_rank, job.AttributionArgs) over the layers the model
    trained (prism.grad_cache.trained_start_layer); None with grad_rank 0, or (logged) when those layers hold no
    nn.Linear (GPT-2's Conv1D)."""
    if not args.grad_rank:
        return None
    try:
        return GradientCache(model, trained_start_layer(model), rank=args.grad_rank, seed=GRADIENT_SEED)
    except ValueError as err:
        logger.warning("no gradient store: %s", err)
        return None


GRADIENT_SEED = 0  # the projections' seed (they are stored with the cache; the seed only makes builds repeatable)
TOKENS_PER_CHUNK = 65536  # token rows read at once by the gradient store's passes


def write_gradient_store(grads: GradientCache, files, n_sequences: int, n_tokens: int, folder: Path,
                         run_id: str, progress=None, hooks: JobHooks = NO_HOOKS) -> None:
    """The gradient store from the fit pass's token files (job.TokenFiles with gx and gd; progress: job.Progress):
    every sequence's projected gradient summed from its tokens' factors, EK-FAC fitted on them
    (prism.grad_cache.GradientCache.fit), then every token's factors sorted by the token it predicted
    (TokenGradientIndex's layout) as .npy files the app memory-maps (x, d (n, M, r) float16; token, sequence,
    position (n,) int32), the projections and the preconditioner as preconditioner.safetensors, and meta.json
    naming the run. Written atomically (a killed job writes it again on resume: `--hook kill-at=gradients:1` kills
    it halfway)."""
    if not n_tokens:
        raise ValueError("the gradient store has no token to fit its preconditioner on")
    progress = progress or (lambda phase, done, total: None)
    n_modules, rank = len(grads.modules), grads.rank
    total = torch.zeros(n_sequences, grads.dim, dtype=torch.float32)
    stats: dict = {}
    chunks = range(0, n_tokens, TOKENS_PER_CHUNK)
    steps, done = 3 * len(chunks), 0  # three passes over the tokens: fit, then x, then d in token order
    for lo in tqdm(chunks, desc="attribution: gradient store", unit="chunk"):
        t = files.read(lo, min(lo + TOKENS_PER_CHUNK, n_tokens), ("gx", "gd", "seq"))
        summed_gradients(torch.from_numpy(t["seq"][:, 0].astype(np.int64)),
                         torch.from_numpy(t["gx"].reshape(-1, n_modules, rank).astype(np.float32)),
                         torch.from_numpy(t["gd"].reshape(-1, n_modules, rank).astype(np.float32)),
                         n_sequences, stats, out=total)
        done += 1
        progress("gradient store", done, steps)
    grads.fit(total, stats)
    y = np.fromfile(files.path("y"), dtype=np.int32, count=n_tokens)
    order = np.argsort(y, kind="stable")
    with replacing_folder(folder) as tmp:
        np.save(tmp / "token.npy", y[order])
        for name, source in (("sequence", "seq"), ("position", "pos")):
            np.save(tmp / f"{name}.npy", np.fromfile(files.path(source), dtype=np.int32, count=n_tokens)[order])
        for name, source in (("x", "gx"), ("d", "gd")):
            flat = np.memmap(files.path(source), dtype=np.float16, mode="r", shape=(n_tokens, n_modules * rank))
            out = np.lib.format.open_memmap(tmp / f"{name}.npy", "w+", np.float16, (n_tokens, n_modules, rank))
            for lo in chunks:
                rows = order[lo: lo + TOKENS_PER_CHUNK]
                out[lo: lo + len(rows)] = flat[rows].reshape(-1, n_modules, rank)
                done += 1
                progress("gradient store", done, steps)
            out.flush()
            del out, flat
            hooks.kill("gradients", 1)
        save_file(grads.state(), str(tmp / "preconditioner.safetensors"))
        (tmp / "meta.json").write_text(json.dumps({
            "format": GRADIENT_FORMAT, "run_id": run_id, "n_sequences": n_sequences, "n_tokens": n_tokens,
            "rank": rank, "start_layer": grads.start_layer, "seed": GRADIENT_SEED,
            "modules": [name for name, _ in grads.modules]}))
