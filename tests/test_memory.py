"""prism.memory: training keeps freed memory, so a buffer allocated again is not faulted in afresh."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from prism import memory

ROOT = Path(__file__).resolve().parents[1]

# Allocate, fill and free a 64 MiB tensor (above glibc's largest mmap threshold) twelve times; print the minor page
# faults of each round. The first rounds may fault while the heap grows; the steady state is what a training step
# sees.
PROBE = """
import json, resource, sys, torch
from prism.memory import allocator, keep_freed_memory
state = keep_freed_memory() if sys.argv[1] == "keep" else allocator()
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(16 * 2**20)
    x.fill_(1.0)
    del x
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"allocator": state, "faults": faults}))
"""
PAGES = 64 * 2**20 // os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 16384


def _probe(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_kept_memory_is_reused_without_page_faults_and_released_memory_is_not():
    released, kept = _probe("release"), _probe("keep")
    assert released["allocator"] == "glibc" and kept["allocator"] == "glibc, freed memory kept"
    # glibc's default: every round maps the buffer afresh and faults in every page of it
    assert min(released["faults"][8:]) > PAGES // 2, released
    # kept: after the heap has grown, the rounds reuse the freed pages (less than half a round's pages in the last 4)
    assert sum(kept["faults"][8:]) < PAGES // 2, kept


# Free 3 GiB at the heap's top at once (a PRISM step's peak holds several (tokens x vocabulary) buffers), then
# allocate and fill 256 MiB: kept memory serves it without a fault. With the largest positive trim threshold mallopt
# takes (2 GiB) glibc gave that top back to the kernel and the buffer faulted in afresh (65,504 faults on a 2-core
# AMD EPYC). malloc and free straight from libc (torch's CPU allocator calls them), so that no Python object lands
# above the buffers at the heap's top.
PEAK = """
import ctypes, json, resource
from prism.memory import keep_freed_memory
state = keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
half = 3 * 2**29  # 1.5 GiB
first = libc.malloc(half)
libc.memset(first, 1, half)
second = libc.malloc(half)
libc.memset(second, 1, half)
libc.free(second)
libc.free(first)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
again = libc.malloc(2**28)
libc.memset(again, 1, 2**28)
print(json.dumps({"allocator": state, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_memory_freed_above_two_gib_at_once_is_kept_too():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", PEAK], capture_output=True, text=True, env=env, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["allocator"] == "glibc, freed memory kept"
    assert out["faults"] < 256 * 2**20 // os.sysconf("SC_PAGE_SIZE") // 10, out  # a tenth of its pages at most


def test_a_preloaded_allocator_is_left_alone(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert memory.preloaded_allocator() == "jemalloc"
    assert memory.keep_freed_memory() == "jemalloc (preloaded): unchanged"
    assert memory.allocator() == "jemalloc (preloaded)"
    monkeypatch.delenv("LD_PRELOAD")
    assert memory.preloaded_allocator() is None
