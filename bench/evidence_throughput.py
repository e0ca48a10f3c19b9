"""Evidence job throughput vs a plain forward pass over the same batches, side by side.

    python -m bench.evidence_throughput --model runs/prism/final --corpus default --batches 12

Batches of windows are built exactly as the evidence job builds them; each batch is timed twice, once as a plain
forward pass of the model and once through the job's processing (forward plus every accumulator), alternating
which goes first. Prints one JSON line: median seconds per batch of each, tokens/s, and the ratio of job to plain
throughput (goal: >= 0.90).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from precompute.evidence import EvidenceArgs, RankState, process_windows
from precompute.inputs import document_windows, load_corpus, load_model
from prism import cli


def main(argv: list[str] | None = None) -> dict:
    parser = cli.parser("python -m bench.evidence_throughput", __doc__, formatter="plain")
    parser.add_argument("--model", required=True)
    parser.add_argument("--corpus", required=True)
    parser.add_argument("--batches", type=int, default=12, help="timed batches (after one warm-up)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--top-n", type=int, default=32)
    ns = parser.parse_args(argv)
    model, tokenizer, _ = load_model(ns.model)
    documents, _ = load_corpus(ns.corpus)
    args = EvidenceArgs(top_n=ns.top_n, seq_len=ns.seq_len, batch_size=ns.batch_size)
    need = (ns.batches + 1) * ns.batch_size
    windows = []
    for i, doc in enumerate(documents):
        windows += document_windows(i, doc.text, tokenizer, ns.seq_len)[0]
        if len(windows) >= need:
            break
    batches = [windows[i: i + ns.batch_size] for i in range(0, need, ns.batch_size)]
    state = RankState(model.config.n_prototypes, args)
    pad = tokenizer.eos_token_id or 0

    def plain(batch):
        T = max(len(w.ids) for w in batch)
        ids = np.full((len(batch), T), pad, np.int64)
        mask = np.zeros_like(ids)
        for b, w in enumerate(batch):
            ids[b, : len(w.ids)], mask[b, : len(w.ids)] = w.ids, 1
        with torch.no_grad():
            model(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))

    times = {"plain": [], "job": []}
    tokens = []
    for n, batch in enumerate(batches):
        pair = [("plain", lambda b=batch: plain(b)), ("job", lambda b=batch: process_windows(model, b, state, args,
                                                                                              pad))]
        for name, fn in pair if n % 2 == 0 else pair[::-1]:
            t0 = time.perf_counter()
            fn()
            if n > 0:
                times[name].append(time.perf_counter() - t0)
        if n > 0:
            tokens.append(sum(len(w.ids) for w in batch))
    med = {k: statistics.median(v) for k, v in times.items()}
    per_batch = statistics.median(tokens)
    result = {"batches": ns.batches, "tokens_per_batch": per_batch, "plain_s_per_batch": med["plain"],
              "job_s_per_batch": med["job"], "plain_tokens_per_s": per_batch / med["plain"],
              "job_tokens_per_s": per_batch / med["job"], "ratio": med["plain"] / med["job"],
              "n_prototypes": model.config.n_prototypes, "top_n": ns.top_n}
    cli.print_json(result)
    return result


if __name__ == "__main__":
    main()
