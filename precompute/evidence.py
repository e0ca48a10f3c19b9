"""The evidence job: run a PRISM model over a corpus and keep what a prototype card needs.

    python -m precompute.evidence --model runs/prism/final --corpus default --db out.duckdb
    torchrun --standalone --nproc-per-node 2 -m precompute.evidence ...      # shards the corpus by rank

Per prototype: the top-N activating token positions (document, token and character offsets, the exact input
sequence, a context window as parallel token/activation arrays), activation count/mean/max and a histogram, the
prototypes it co-activates with, the tokens that follow its evidence, and its logit signature (top tokens of W p_i).

How it runs. Documents are read in corpus order; rank r of a world of w processes documents i with i % w == r.
Each document is tokenized once (with character offsets) and cut into windows of --seq-len tokens; windows are
batched, so one forward pass serves many documents. Running state (top-N per prototype with their contexts, the
statistics, the documents still referenced) is checkpointed atomically after every chunk of documents, so a
killed job restarts from its last chunk and ends with exactly the result of an uninterrupted run. At the end each
rank writes Parquet shards; a merge (rank 0, after every rank finished) combines them and writes every table of
the job in one DuckDB transaction. The global order of evidence is (activation desc, document index, token
position), the same whatever the number of ranks.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from precompute.inputs import Context, Job, Window, add_input_arguments, document_windows, job_command
from precompute.runs import (
    NO_HOOKS,
    JobHooks,
    connect,
    finish_job,
    replacing_folder,
    saved_folder,
    start_job,
    transaction,
)
from prism import PrismForCausalLM, cli
from prism.cli import arg

logger = logging.getLogger("precompute.evidence")

NAME = "evidence"  # the job's row in `runs`, its tables in schema.JOB_TABLES
POSITION_BITS = 24  # key = doc_index << POSITION_BITS | token_position: documents up to 16M tokens


@dataclass
class EvidenceArgs:
    top_n: int = arg(32, "evidence rows kept per prototype")
    seq_len: int = arg(256, "tokens per model input window")
    batch_size: int = arg(8, "windows per forward pass")
    context_before: int = arg(12, "context tokens kept before the evidence token")
    context_after: int = arg(4, "context tokens kept after it (within the same input window)")
    n_bins: int = arg(20, "activation histogram bins over [0, 1]")
    top_coactive: int = arg(10, "co-active prototypes kept per prototype")
    top_next: int = arg(10, "most frequent next tokens kept per prototype")
    top_signature: int = arg(20, "tokens of the logit signature W p kept per prototype")
    docs_per_chunk: int = arg(64, "documents per committed chunk (a killed job resumes after the last one)")
    limit: int | None = arg(None, "read at most this many documents")

    def __post_init__(self) -> None:
        for name in ("top_n", "seq_len", "batch_size", "n_bins", "docs_per_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


# ----------------------------------------------------------------------------------------------------------------
# Running state of one rank.


class RankState:
    """Accumulators for one rank; arrays indexed [prototype] or [prototype, slot] (slot = rank among its top-N).
    The top-N are ranked by SCORE, an entry field: the activation here (precompute/bands.py ranks by a priority)."""

    SCORE = "act"

    ENTRY_FIELDS = {  # name -> (dtype, fill); one value per (prototype, slot)
        "act": (np.float32, -np.inf), "key": (np.int64, -1), "seq_start": (np.int32, 0), "seq_end": (np.int32, 0),
        "char_start": (np.int32, 0), "char_end": (np.int32, 0), "token_id": (np.int32, -1),
        "next_token_id": (np.int32, -1), "ctx_start": (np.int32, 0),
    }
    CTX_FIELDS = {"ctx_ids": (np.int32, -1), "ctx_act": (np.float32, 0.0), "ctx_cs": (np.int32, 0),
                  "ctx_ce": (np.int32, 0)}

    def __init__(self, n_prototypes: int, args: EvidenceArgs) -> None:
        K, N, C = n_prototypes, args.top_n, args.context_before + 1 + args.context_after
        self.K, self.N, self.C, self.n_bins = K, N, C, args.n_bins
        self.count = np.zeros(K, np.int64)
        self.sum = np.zeros(K, np.float64)
        self.max = np.zeros(K, np.float32)
        self.hist = np.zeros((K, args.n_bins), np.int64)
        self.coact = np.zeros(K * K, np.int64) if K <= 2048 else None
        self.coact_sparse: dict[int, int] = {}
        self.entries = {n: np.full((K, N), fill, dtype) for n, (dtype, fill) in self.ENTRY_FIELDS.items()}
        self.entries.update({n: np.full((K, N, C), fill, dtype) for n, (dtype, fill) in self.CTX_FIELDS.items()})
        self.docs: dict[int, dict] = {}  # doc_index -> document row, for documents evidence points into
        self.docs_seen = 0  # global corpus position: documents before it are done (by this rank)
        self.chunks = 0
        self.tokens = 0

    # -- persistence ----------------------------------------------------------------------------------------

    def save(self, folder: Path) -> None:
        """Atomic: write a new folder, then swap it in (runs.replacing_folder)."""
        self._prune_docs()
        arrays = {"count": self.count, "sum": self.sum, "max": self.max, "hist": self.hist, **self.entries}
        if self.coact is not None:
            arrays["coact"] = self.coact
        else:
            keys = np.fromiter(self.coact_sparse.keys(), np.int64, len(self.coact_sparse))
            arrays["coact_keys"], arrays["coact_vals"] = keys, np.array([self.coact_sparse[k] for k in keys], np.int64)
        with replacing_folder(folder) as tmp:
            np.savez(tmp / "arrays.npz", **arrays)
            (tmp / "state.json").write_text(json.dumps({"docs_seen": self.docs_seen, "chunks": self.chunks,
                                                         "tokens": self.tokens, "docs": self.docs}))

    @classmethod
    def load(cls, folder: Path, n_prototypes: int, args: EvidenceArgs) -> RankState:
        state = cls(n_prototypes, args)
        folder = saved_folder(folder)
        if not folder.exists():
            return state
        with np.load(folder / "arrays.npz") as arrays:
            state.count, state.sum, state.max, state.hist = (arrays[n] for n in ("count", "sum", "max", "hist"))
            for name in state.entries:
                state.entries[name] = arrays[name]
            if "coact" in arrays:
                state.coact = arrays["coact"]
            else:
                state.coact_sparse = dict(zip(arrays["coact_keys"].tolist(), arrays["coact_vals"].tolist()))
        meta = json.loads((folder / "state.json").read_text())
        state.docs_seen, state.chunks, state.tokens = meta["docs_seen"], meta["chunks"], meta["tokens"]
        state.docs = {int(k): v for k, v in meta["docs"].items()}
        return state

    def _prune_docs(self) -> None:
        keys = self.entries["key"]
        referenced = set((keys[keys >= 0] >> POSITION_BITS).tolist())
        self.docs = {i: d for i, d in self.docs.items() if i in referenced}

    # -- accumulation ---------------------------------------------------------------------------------------

    def add_stats(self, ids: np.ndarray, acts: np.ndarray) -> None:
        """ids, acts (M, k) of valid tokens."""
        K = self.K
        active = acts > 0
        flat_ids, flat_acts = ids[active], acts[active]
        self.count += np.bincount(flat_ids, minlength=K)
        self.sum += np.bincount(flat_ids, weights=flat_acts.astype(np.float64), minlength=K)
        np.maximum.at(self.max, flat_ids, flat_acts)
        bins = np.minimum((flat_acts * self.n_bins).astype(np.int64), self.n_bins - 1)
        self.hist += np.bincount(flat_ids * self.n_bins + bins, minlength=K * self.n_bins).reshape(K, self.n_bins)
        k = ids.shape[1]
        pairs = []
        for a in range(k):
            for b in range(k):
                if a != b:
                    both = active[:, a] & active[:, b]
                    pairs.append(ids[both, a].astype(np.int64) * K + ids[both, b])
        keys = np.concatenate(pairs) if pairs else np.zeros(0, np.int64)
        if self.coact is not None:
            self.coact += np.bincount(keys, minlength=K * K)
        else:
            uniq, counts = np.unique(keys, return_counts=True)
            for key, c in zip(uniq.tolist(), counts.tolist()):
                self.coact_sparse[key] = self.coact_sparse.get(key, 0) + c
        self.tokens += len(ids)

    def score(self, proto: np.ndarray, act: np.ndarray, key: np.ndarray) -> np.ndarray:
        """What candidates are ranked by (higher first; ties by key): their activation."""
        return act

    def merge_candidates(self, proto: np.ndarray, score: np.ndarray, key: np.ndarray) -> tuple[np.ndarray, ...]:
        """Merge candidates into the top-N by score. Returns (proto, slot, candidate index) of the candidates that
        entered, after moving the surviving old entries to their new slots."""
        K, N = self.K, self.N
        threshold = self.entries[self.SCORE][:, -1]
        # A candidate tying the threshold can still enter on its key, so compare with >=.
        keep = score >= threshold[proto]
        proto, score, key = proto[keep], score[keep], key[keep]
        cand_idx = np.flatnonzero(keep)
        n_old = K * N
        all_p = np.concatenate([np.repeat(np.arange(K), N), proto])
        all_a = np.concatenate([self.entries[self.SCORE].ravel(), score])
        all_k = np.concatenate([self.entries["key"].ravel(), key])
        src = np.arange(len(all_p))
        # Sort by prototype, activation desc, key asc; empty slots (-inf) sort last within their prototype.
        order = np.lexsort((np.where(all_k < 0, np.iinfo(np.int64).max, all_k), -all_a.astype(np.float64), all_p))
        p_sorted = all_p[order]
        starts = np.searchsorted(p_sorted, np.arange(K))
        slot = np.arange(len(order)) - starts[p_sorted]
        top = slot < N
        order, p_top, slot_top = order[top], p_sorted[top], slot[top]
        chosen = src[order]
        from_old = chosen < n_old
        for name, arr in self.entries.items():
            flat = arr.reshape(K * N, *arr.shape[2:])
            new = np.empty_like(arr)
            new[p_top[from_old], slot_top[from_old]] = flat[chosen[from_old]]
            self.entries[name] = new
        new_mask = ~from_old
        return p_top[new_mask], slot_top[new_mask], cand_idx[chosen[new_mask] - n_old]


# ----------------------------------------------------------------------------------------------------------------
# Processing.


@torch.no_grad()
def process_windows(model: PrismForCausalLM, windows: list[Window], state: RankState, args: EvidenceArgs,
                    pad_id: int) -> None:
    """One forward pass over a batch of windows, folded into the state."""
    B, T = len(windows), max(len(w.ids) for w in windows)
    input_ids = np.full((B, T), pad_id, np.int64)
    mask = np.zeros((B, T), np.int64)
    offsets = np.zeros((B, T, 2), np.int32)
    next_ids = np.full((B, T), -1, np.int32)
    for b, w in enumerate(windows):
        n = len(w.ids)
        input_ids[b, :n], mask[b, :n], offsets[b, :n], next_ids[b, :n] = w.ids, 1, w.offsets, w.next_ids
    out = model(torch.from_numpy(input_ids), attention_mask=torch.from_numpy(mask))
    ids = out.prototype_ids.numpy()  # (B, T, k)
    acts = out.activations.float().numpy()  # (B, T, k)
    valid = mask.astype(bool)
    state.add_stats(ids[valid], acts[valid])

    # Candidates for the top-N: every active (token, prototype) pair.
    bb, tt, jj = np.nonzero((acts > 0) & valid[:, :, None])
    proto = ids[bb, tt, jj]
    doc_index = np.array([w.doc_index for w in windows], np.int64)
    seq_start = np.array([w.seq_start for w in windows], np.int64)
    key = (doc_index[bb] << POSITION_BITS) | (seq_start[bb] + tt)
    score = state.score(proto, acts[bb, tt, jj], key)
    p_new, slot_new, cand = state.merge_candidates(proto, score, key)
    if len(cand) == 0:
        return
    b, t, p = bb[cand], tt[cand], p_new
    e = state.entries
    lengths = mask.sum(1)
    e["act"][p, slot_new] = acts[b, t, jj[cand]]
    e[state.SCORE][p, slot_new] = score[cand]
    e["key"][p, slot_new] = key[cand]
    e["seq_start"][p, slot_new] = seq_start[b]
    e["seq_end"][p, slot_new] = seq_start[b] + lengths[b]
    e["char_start"][p, slot_new], e["char_end"][p, slot_new] = offsets[b, t, 0], offsets[b, t, 1]
    e["token_id"][p, slot_new] = input_ids[b, t]
    e["next_token_id"][p, slot_new] = next_ids[b, t]
    ctx0 = np.maximum(t - args.context_before, 0)
    e["ctx_start"][p, slot_new] = seq_start[b] + ctx0
    grid = ctx0[:, None] + np.arange(state.C)[None, :]  # (m, C)
    inside = grid < np.minimum(t + args.context_after + 1, lengths[b])[:, None]
    g = np.minimum(grid, T - 1)
    ctx_act = ((ids[b[:, None], g] == p[:, None, None]) * acts[b[:, None], g]).sum(-1)  # (m, C)
    e["ctx_ids"][p, slot_new] = np.where(inside, input_ids[b[:, None], g], -1)
    e["ctx_act"][p, slot_new] = np.where(inside, ctx_act, 0.0)
    e["ctx_cs"][p, slot_new] = np.where(inside, offsets[b[:, None], g, 0], 0)
    e["ctx_ce"][p, slot_new] = np.where(inside, offsets[b[:, None], g, 1], 0)


def run_rank(model: PrismForCausalLM, tokenizer, documents, args: EvidenceArgs, work: Path, rank: int,
             world: int, hooks: JobHooks = NO_HOOKS, state_class: type[RankState] = RankState,
             name: str = NAME) -> RankState:
    """Process this rank's share of the documents, resuming from work/rank{rank}; returns the final state."""
    folder = work / f"rank{rank}"
    state = state_class.load(folder, model.config.n_prototypes, args)
    if (folder / "complete").exists():
        return state
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    bar = tqdm(desc=f"{name} (rank {rank})", unit="doc", initial=state.docs_seen, disable=rank != 0)
    chunk: list[Window] = []
    chunk_docs = 0
    position = 0
    for position, doc in enumerate(documents):
        if args.limit is not None and position >= args.limit:
            break
        if position < state.docs_seen or position % world != rank:
            continue
        windows, n_tokens = document_windows(position, doc.text, tokenizer, args.seq_len)
        state.docs[position] = {"doc_id": doc.doc_id, "source": doc.source, "url": doc.url, "title": doc.title,
                                "text": doc.text, "sha256": doc.sha256, "n_chars": len(doc.text),
                                "n_tokens": n_tokens}
        chunk.extend(windows)
        chunk_docs += 1
        if chunk_docs == args.docs_per_chunk:
            _process_chunk(model, chunk, state, args, pad_id)
            state.docs_seen = position + 1
            hooks.kill("chunk", state.chunks)
            state.save(folder)
            bar.update(chunk_docs * world)
            chunk, chunk_docs = [], 0
    if chunk:
        _process_chunk(model, chunk, state, args, pad_id)
        hooks.kill("chunk", state.chunks)
    state.docs_seen = position + 1
    state.save(folder)
    (folder / "complete").write_text("ok")
    bar.close()
    return state


def _process_chunk(model, chunk: list[Window], state: RankState, args: EvidenceArgs, pad_id: int) -> None:
    for lo in range(0, len(chunk), args.batch_size):
        process_windows(model, chunk[lo: lo + args.batch_size], state, args, pad_id)
    state.chunks += 1


# ----------------------------------------------------------------------------------------------------------------
# Shards and merge.


def write_shard(state: RankState, tokenizer, work: Path, rank: int) -> None:
    """This rank's partial results as Parquet files: entries, stats, co-activations, documents."""
    e, K = state.entries, state.K
    valid = e["key"] >= 0
    p, s = np.nonzero(valid)
    doc_index = (e["key"][p, s] >> POSITION_BITS).astype(np.int64)
    position = (e["key"][p, s] & ((1 << POSITION_BITS) - 1)).astype(np.int64)
    entries = pa.table({
        "prototype_id": p.astype(np.int32), "activation": e["act"][p, s].astype(np.float64),
        "key": e["key"][p, s], "doc_index": doc_index, "token_position": position.astype(np.int32),
        "seq_token_start": e["seq_start"][p, s], "seq_token_end": e["seq_end"][p, s],
        "char_start": e["char_start"][p, s], "char_end": e["char_end"][p, s], "token_id": e["token_id"][p, s],
        "next_token_id": e["next_token_id"][p, s], "context_start": e["ctx_start"][p, s],
        "ctx_ids": list(e["ctx_ids"][p, s]), "ctx_act": list(e["ctx_act"][p, s].astype(np.float64)),
        "ctx_cs": list(e["ctx_cs"][p, s]), "ctx_ce": list(e["ctx_ce"][p, s]),
    })
    if state.SCORE != "act":
        entries = entries.append_column("score", pa.array(e[state.SCORE][p, s].astype(np.float64)))
    stats = pa.table({"prototype_id": np.arange(K, dtype=np.int32), "count": state.count, "sum": state.sum,
                      "max": state.max.astype(np.float64), "hist": list(state.hist)})
    if state.coact is not None:
        nz = np.flatnonzero(state.coact)
        keys, vals = nz, state.coact[nz]
    else:
        keys = np.fromiter(state.coact_sparse.keys(), np.int64, len(state.coact_sparse))
        vals = np.array([state.coact_sparse[k] for k in keys], np.int64)
    coact = pa.table({"prototype_id": (keys // K).astype(np.int32), "other_id": (keys % K).astype(np.int32),
                      "count": vals})
    docs = pa.Table.from_pylist([{"doc_index": i, **d} for i, d in sorted(state.docs.items())],
                                schema=pa.schema([("doc_index", pa.int64()), ("doc_id", pa.string()),
                                                  ("source", pa.string()), ("url", pa.string()),
                                                  ("title", pa.string()), ("text", pa.string()),
                                                  ("sha256", pa.string()), ("n_chars", pa.int32()),
                                                  ("n_tokens", pa.int32())]))
    for name, table in (("entries", entries), ("stats", stats), ("coact", coact), ("docs", docs)):
        pq.write_table(table, work / f"{name}-rank{rank}.parquet")
    (work / f"shard-rank{rank}.done").write_text(json.dumps({"tokens": state.tokens}))


def referenced_documents(con: duckdb.DuckDBPyConnection, files: list[str], top):
    """The shards' document rows that the kept entries point into, in corpus order."""
    docs = con.execute("SELECT * FROM read_parquet(?)", [files]).fetch_df()
    return docs[docs["doc_index"].isin(set(top["doc_index"]))].sort_values("doc_index")


def evidence_rows(top, docs) -> dict:
    """The evidence table's columns (also evidence_bands'), from kept entries with a rank and their documents."""
    text_of = dict(zip(docs["doc_index"], docs["text"]))
    doc_id_of = dict(zip(docs["doc_index"], docs["doc_id"]))

    def piece(row, start, end):
        return text_of[row.doc_index][start:end]

    evidence = {
        "prototype_id": top["prototype_id"].astype(np.int32), "rank": top["rank"],
        "doc_id": [doc_id_of[i] for i in top["doc_index"]], "token_position": top["token_position"],
        "seq_token_start": top["seq_token_start"], "seq_token_end": top["seq_token_end"],
        "char_start": top["char_start"], "char_end": top["char_end"], "activation": top["activation"],
        "token_id": top["token_id"],
        "token": [piece(r, r.char_start, r.char_end) for r in top.itertuples()],
        "next_token_id": [None if v < 0 else int(v) for v in top["next_token_id"]],
        "context_start": top["context_start"],
    }
    ctx_tokens, ctx_acts, ctx_cs, ctx_ce = [], [], [], []
    for r in top.itertuples():
        keep = np.asarray(r.ctx_ids) >= 0
        cs, ce = np.asarray(r.ctx_cs)[keep], np.asarray(r.ctx_ce)[keep]
        ctx_tokens.append([text_of[r.doc_index][a:b] for a, b in zip(cs, ce)])
        ctx_acts.append(np.asarray(r.ctx_act)[keep].tolist())
        ctx_cs.append(cs.tolist())
        ctx_ce.append(ce.tolist())
    evidence.update(context_tokens=ctx_tokens, context_activations=ctx_acts, context_char_starts=ctx_cs,
                    context_char_ends=ctx_ce)
    return evidence


def documents_rows(docs) -> dict:
    return {"doc_id": docs["doc_id"], "source": docs["source"], "url": docs["url"], "title": docs["title"],
            "text": docs["text"], "sha256": docs["sha256"], "n_chars": docs["n_chars"], "n_tokens": docs["n_tokens"]}


def write_tables(con: duckdb.DuckDBPyConnection, job: str, tables: dict) -> None:
    """Replace the job's tables with these rows and mark it done, in one transaction."""
    with transaction(con):
        for name, data in tables.items():
            frame = pa.table(dict(data)) if isinstance(data, dict) else pa.Table.from_pandas(data,
                                                                                              preserve_index=False)
            con.execute(f"DELETE FROM {name}")  # names from the schema module; a failed earlier merge leaves none
            con.register("incoming", frame)
            columns = ", ".join(frame.column_names)
            con.execute(f"INSERT INTO {name} ({columns}) SELECT {columns} FROM incoming")
            con.unregister("incoming")
        finish_job(con, job)


def merge(con: duckdb.DuckDBPyConnection, work: Path, model: PrismForCausalLM, tokenizer, args: EvidenceArgs,
          world: int) -> dict:
    """Combine every rank's shards into the job's tables, in one transaction."""
    missing = [r for r in range(world) if not (work / f"shard-rank{r}.done").exists()]
    if missing:
        raise RuntimeError(f"cannot merge: ranks {missing} have not finished their shards in {work}")
    files = {name: [str(work / f"{name}-rank{r}.parquet") for r in range(world)]
             for name in ("entries", "stats", "coact", "docs")}
    top = con.execute(f"""
        SELECT * EXCLUDE (r) FROM (
            SELECT *, row_number() OVER (PARTITION BY prototype_id ORDER BY activation DESC, key ASC) - 1 AS r
            FROM read_parquet(?)) WHERE r < {int(args.top_n)}
        ORDER BY prototype_id, r""", [files["entries"]]).fetch_df()
    top["rank"] = top.groupby("prototype_id").cumcount().astype(np.int32)
    docs = referenced_documents(con, files["docs"], top)
    evidence = evidence_rows(top, docs)

    stats = con.execute("SELECT prototype_id, sum(count) AS c, sum(sum) AS s, max(max) AS m "
                        "FROM read_parquet(?) GROUP BY prototype_id ORDER BY prototype_id",
                        [files["stats"]]).fetch_df()
    hist = np.zeros((model.config.n_prototypes, args.n_bins), np.int64)
    for f in files["stats"]:
        t = pq.read_table(f, columns=["prototype_id", "hist"]).to_pydict()
        hist[np.asarray(t["prototype_id"])] += np.asarray(t["hist"], dtype=np.int64)
    edges = np.linspace(0.0, 1.0, args.n_bins + 1).tolist()
    prototype_stats = {
        "prototype_id": stats["prototype_id"].astype(np.int32), "activation_count": stats["c"].astype(np.int64),
        "mean_activation": [s / c if c else None for s, c in zip(stats["s"], stats["c"])],
        "max_activation": [m if c else None for m, c in zip(stats["m"], stats["c"])],
        "hist_edges": [edges] * len(stats), "hist_counts": [h.tolist() for h in hist[stats["prototype_id"]]],
    }
    coact = con.execute(f"""
        SELECT prototype_id, other_id, c AS count, r AS rank FROM (
            SELECT prototype_id, other_id, sum(count) AS c,
                   row_number() OVER (PARTITION BY prototype_id ORDER BY sum(count) DESC, other_id) - 1 AS r
            FROM read_parquet(?) GROUP BY prototype_id, other_id) WHERE r < {int(args.top_coactive)}
        ORDER BY prototype_id, r""", [files["coact"]]).fetch_df()

    nxt = top[top["next_token_id"] >= 0].groupby(["prototype_id", "next_token_id"]).size().reset_index(name="count")
    nxt = nxt.sort_values(["prototype_id", "count", "next_token_id"], ascending=[True, False, True])
    nxt["rank"] = nxt.groupby("prototype_id").cumcount()
    nxt = nxt[nxt["rank"] < args.top_next]
    next_tokens = {"prototype_id": nxt["prototype_id"].astype(np.int32), "rank": nxt["rank"].astype(np.int32),
                   "token_id": nxt["next_token_id"].astype(np.int32),
                   "token": [tokenizer.decode([int(t)]) for t in nxt["next_token_id"]],
                   "count": nxt["count"].astype(np.int32)}

    signatures = logit_signatures(model, tokenizer, args.top_signature)
    tables = {"documents": documents_rows(docs), "evidence": evidence, "prototype_stats": prototype_stats,
              "coactivations": coact, "next_tokens": next_tokens, "logit_signatures": signatures}
    write_tables(con, NAME, tables)
    tokens = sum(json.loads((work / f"shard-rank{r}.done").read_text())["tokens"] for r in range(world))
    return {"tokens": tokens, "evidence_rows": len(top), "documents": len(docs)}


@torch.no_grad()
def logit_signatures(model: PrismForCausalLM, tokenizer, top: int) -> dict:
    """The top tokens of W p_i for every prototype (the logit each prototype adds per unit of activation)."""
    weight, rows = model.prototypes.weight, {"prototype_id": [], "rank": [], "token_id": [], "token": [],
                                             "value": []}
    for lo in range(0, weight.shape[0], 256):
        sig = model.lm_head(weight[lo: lo + 256]) - (model.lm_head.bias if model.lm_head.bias is not None else 0)
        values, ids = sig.topk(min(top, sig.shape[-1]), dim=-1)  # (b, top)
        for i in range(ids.shape[0]):
            for r in range(ids.shape[1]):
                rows["prototype_id"].append(lo + i)
                rows["rank"].append(r)
                rows["token_id"].append(int(ids[i, r]))
                rows["token"].append(tokenizer.decode([int(ids[i, r])]))
                rows["value"].append(float(values[i, r]))
    return rows


# ----------------------------------------------------------------------------------------------------------------
# The job.


def work_folder(db: Path, name: str = NAME) -> Path:
    return db.with_name(f"{db.name}.{name}")


def run(db: str | Path, model: PrismForCausalLM, tokenizer, documents, args: EvidenceArgs, job_args: dict,
        overwrite: bool = False, hooks: JobHooks = NO_HOOKS, name: str = NAME,
        state_class: type[RankState] = RankState, merge_fn=None) -> dict | None:
    """Run the evidence job (this process's rank) and, on rank 0, merge into the database.

    `documents` is an iterable of precompute.corpus.Document in a deterministic order; job_args are stored in
    the database (model and corpus identity plus EvidenceArgs). The bands job (precompute/bands.py) runs the same
    pass under its own name, state class and merge."""
    db = Path(db)
    merge_fn = merge_fn or merge
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    work = work_folder(db, name)
    if rank == 0:
        con = connect(db)
        status = start_job(con, name, {**job_args, **asdict(args), "world_size": world}, overwrite=overwrite)
        if status == "new":
            shutil.rmtree(work, ignore_errors=True)
        con.close()
    else:
        status = None
    status = _broadcast(status)
    if status == "done":
        logger.info("%s already built with these arguments in %s", name, db)
        if rank == 0:
            shutil.rmtree(work, ignore_errors=True)
        return None
    work.mkdir(parents=True, exist_ok=True)
    model.eval()
    state = run_rank(model, tokenizer, documents, args, work, rank, world, hooks, state_class, name)
    write_shard(state, tokenizer, work, rank)
    if dist.is_initialized():
        dist.barrier()
    if rank != 0:
        return None
    con = connect(db)
    try:
        summary = merge_fn(con, work, model, tokenizer, args, world)
    finally:
        con.close()
    shutil.rmtree(work, ignore_errors=True)
    logger.info("%s: %s", name, summary)
    return summary


def _broadcast(value):
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run_job(context: Context) -> dict | None:
    """The job interface (precompute/inputs.py): this rank's part, and on rank 0 the merge."""
    model, tokenizer, _ = context.inputs.model()
    documents, _ = context.inputs.corpus()
    return run(context.inputs.db, model, tokenizer, documents, context.args, context.inputs.identity(),
               overwrite=context.overwrite, hooks=context.hooks)


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("python -m precompute.evidence", __doc__)
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_input_arguments(parser)
    cli.add_dataclass_arguments(parser, EvidenceArgs)


def evidence_args(ns: argparse.Namespace) -> EvidenceArgs:
    return EvidenceArgs(**{k: getattr(ns, k) for k in asdict(EvidenceArgs())})


JOB = Job(NAME, EvidenceArgs, run_job, args_from=evidence_args, all_ranks=True)


def main(argv: list[str] | None = None) -> dict | None:
    return job_command(JOB, build_parser(), argv)


if __name__ == "__main__":
    main()
