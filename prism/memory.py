"""Keep freed memory in the process, so training's large buffers are not faulted in afresh at every step.

A training step allocates several (tokens x vocabulary) float32 matrices, 400 MB each at 2,048 tokens and
SmolLM2's 49,152 tokens: the logits, their log-softmax, the gradients (and with the prototype-path terms the path's
logits too). glibc serves every allocation above its mmap threshold (at most 32 MB) with a fresh mmap and returns
it to the kernel on free, so each step touches those pages for the first time again, and on some virtual machines a
first touch is slow: on a 2-core AMD EPYC a fresh 400 MB fill took 0.25 s against 0.02 s reused, and the PRISM step,
which allocates more such buffers than the dense one, ran at 0.81 of dense training's speed instead of 0.98
(docs/RESULTS.md, training throughput). How slow depends on the machine, not on the model.

keep_freed_memory() tells glibc to serve large allocations from its heap and keep freed memory there (mallopt, in
this process only), however much is freed at once: with a trim threshold of 2 GiB (the largest positive value
mallopt takes) glibc still gave the heap's top back whenever a PRISM step freed more than that at once, and the
next step faulted 0.4-1.6 GB in afresh (0.2-1.3 s on a 2-core AMD EPYC, in 4 to 5 of 24 steps in each precision);
-1 disables trimming (mallopt(3)). The process's resident size then stays at its peak instead of falling between
steps, which is what a training run wants and a long-lived app does not: only training and its benchmark call it.
Under another allocator (jemalloc or tcmalloc preloaded, musl) it changes nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

logger = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
KEEP = -1  # M_TRIM_THRESHOLD: never trim the heap's top (2**31 - 1 = 2 GiB still trimmed a PRISM step's)
_kept = False


def preloaded_allocator() -> str | None:
    """The allocator LD_PRELOAD puts in front of glibc's (jemalloc, tcmalloc, mimalloc), if any."""
    for name in ("jemalloc", "tcmalloc", "mimalloc"):
        if name in os.environ.get("LD_PRELOAD", ""):
            return name
    return None


def keep_freed_memory() -> str:
    """Serve large allocations from glibc's heap and keep what is freed there (see the module's docstring).

    Returns what the process's allocator now is: 'glibc, freed memory kept', or why nothing changed."""
    other = preloaded_allocator()
    if other:
        return f"{other} (preloaded): unchanged"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return f"{platform.system()} {platform.libc_ver()[0] or 'libc'}: unchanged"
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    done = [libc.mallopt(M_MMAP_MAX, 0), libc.mallopt(M_TRIM_THRESHOLD, KEEP)]
    if not all(done):
        logger.warning("glibc's mallopt refused a setting (%s): large buffers may be faulted in at every step", done)
        return "glibc: unchanged (mallopt refused)"
    global _kept
    _kept = True
    return allocator()


def allocator() -> str:
    """The allocator as it is now, without changing it: for benchmarks' records."""
    other = preloaded_allocator()
    if other:
        return f"{other} (preloaded)"
    return "glibc, freed memory kept" if _kept else platform.libc_ver()[0] or "unknown"
