"""The attribution job's write side: the passes over the training sequences (fit, factors, vectors, the exact store;
the gradient store is gradients.py's) and the job interface; the package docstring (precompute/attribution/
__init__.py) says what each pass keeps and costs.

    summary = run(db, model, tokenizer, documents, AttributionArgs(max_sequences=4096), job_args)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from tqdm.auto import tqdm

from precompute.attribution.cache import (
    EXACT_ENTRY_ARRAYS,
    EXACT_FORMAT,
    NAME,
    exact_folder,
    gradient_folder,
    index_parts,
    load_factors,
    progress_file,
)
from precompute.attribution.gradients import gradient_cache_for, write_gradient_store
from precompute.inputs import Context, Job, Window, document_windows
from precompute.runs import (
    NO_HOOKS,
    JobHooks,
    connect,
    finish_job,
    get_progress,
    job_run_id,
    replacing_folder,
    saved_folder,
    set_progress,
    start_job,
    transaction,
)
from prism import PrismForCausalLM, cli
from prism.attribution import (
    BlockWhitening,
    CurvatureAccumulator,
    ExactStore,
    SequenceRows,
    TokenStats,
    next_token_targets,
    sequence_gradients,
    token_statistics,
    whitened_basis,
)
from prism.cli import arg
from prism.data import is_validation
from prism.grad_cache import GradientCache

logger = logging.getLogger("precompute.attribution")



@dataclass
class AttributionArgs:
    seq_len: int = arg(256, "tokens per training sequence (the evidence job's windows)")
    batch_size: int = arg(8, "sequences per forward pass")
    docs_per_chunk: int = arg(64, "documents per committed chunk of the fit pass")
    sequences_per_chunk: int = arg(256, "training sequences per committed chunk of cached vectors")
    limit: int | None = arg(None, "read at most this many documents")
    max_sequences: int | None = arg(None, "stop after this many training sequences (default: every window of the "
                                          "corpus)")
    rank: int = arg(128, "coordinates kept per cached vector (0: all d, no projection)")
    damping: float = arg(0.1, "damping, relative to the mean eigenvalue of the curvature")
    holdout: float = arg(0.0, "leave out the documents prism.train held out for validation at this fraction (the "
                              "same doc-id hash, e.g. 0.05), so every sequence is one the model could train on")
    grad_rank: int = arg(16, "projection size r of the gradient store of the trained layers (prism/grad_cache.py: "
                             "2 x r numbers per linear layer and token); 0: no gradient store")

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "docs_per_chunk", "sequences_per_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise ValueError("seq_len must be >= 2: a sequence needs a token and its next token")
        if self.max_sequences is not None and self.max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {self.max_sequences}")
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")
        if not self.damping > 0:
            raise ValueError(f"damping must be > 0, got {self.damping}")
        if not 0 <= self.holdout < 1:
            raise ValueError(f"holdout must be in [0, 1), got {self.holdout}")
        if self.grad_rank < 0:
            raise ValueError(f"grad_rank must be >= 0, got {self.grad_rank}")


# ----------------------------------------------------------------------------------------------------------------
# Work files of the fit pass: per target token, appended in sequence order; truncated to the checkpoint on resume.


class TokenFiles:
    """z (N, d), e (N, d), prototype ids (N, k), activations (N, k), sequence, position, target (N,): flat files;
    with grad_width (M r), the gradient store's projected layer inputs gx and output gradients gd (N, M r), float16."""

    def __init__(self, folder: Path, d_model: int, top_k: int, grad_width: int = 0) -> None:
        self.folder = folder
        self.layout = {"z": (np.float32, d_model), "e": (np.float32, d_model), "ids": (np.int32, top_k),
                       "acts": (np.float32, top_k), "seq": (np.int32, 1), "pos": (np.int32, 1), "y": (np.int32, 1)}
        if grad_width:
            self.layout.update({"gx": (np.float16, grad_width), "gd": (np.float16, grad_width)})
        folder.mkdir(parents=True, exist_ok=True)

    def path(self, name: str) -> Path:
        return self.folder / f"{name}.bin"

    def truncate(self, n_tokens: int) -> None:
        for name, (dtype, width) in self.layout.items():
            path = self.path(name)
            with path.open("ab") as f:
                f.truncate(n_tokens * width * np.dtype(dtype).itemsize)

    def append(self, stats: TokenStats, sequence_offset: int, factors: tuple | None = None) -> None:
        """One batch's tokens; factors: their gradient-store factors (x, d), each (N, M, r), when kept."""
        values = {"z": stats.z, "e": stats.e, "ids": stats.prototype_ids, "acts": stats.activations,
                  "seq": stats.sequence + sequence_offset, "pos": stats.position, "y": stats.target}
        if factors is not None:
            values.update({"gx": factors[0].reshape(len(stats.z), -1), "gd": factors[1].reshape(len(stats.z), -1)})
        for name, (dtype, _) in self.layout.items():
            with self.path(name).open("ab") as f:
                f.write(values[name].numpy().astype(dtype).tobytes())

    def read(self, lo: int, hi: int, names: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
        out = {}
        for name, (dtype, width) in self.layout.items():
            if names is not None and name not in names:
                continue
            size = np.dtype(dtype).itemsize * width
            with self.path(name).open("rb") as f:
                f.seek(lo * size)
                out[name] = np.frombuffer(f.read((hi - lo) * size), dtype=dtype).reshape(hi - lo, width)
        return out


class FitState:
    """The fit pass's running state: curvature sums, the sequences and documents seen, how far it got."""

    SEQUENCE_FIELDS = ("doc_index", "seq_token_start", "seq_token_end", "char_start", "char_end", "n_targets",
                       "loss")

    def __init__(self, model: PrismForCausalLM) -> None:
        self.curvature = CurvatureAccumulator(model.config.n_prototypes, model.d_model, model.vocab_size)
        self.sequences: dict[str, list] = {name: [] for name in self.SEQUENCE_FIELDS}
        self.docs_seen = 0
        self.docs_bytes = 0  # length of docs.jsonl that belongs to the checkpoint
        self.chunks = 0
        self.complete = False

    @property
    def n_sequences(self) -> int:
        return len(self.sequences["doc_index"])

    @property
    def n_tokens(self) -> int:
        return self.curvature.n_tokens

    def save(self, folder: Path) -> None:
        """Atomic: write a new folder, then swap it in (runs.replacing_folder)."""
        with replacing_folder(folder) as tmp:
            np.savez(tmp / "arrays.npz", **self.curvature.state(),
                     **{f"seq_{k}": np.asarray(v) for k, v in self.sequences.items()})
            (tmp / "state.json").write_text(json.dumps({"docs_seen": self.docs_seen, "docs_bytes": self.docs_bytes,
                                                         "chunks": self.chunks, "complete": self.complete}))

    @classmethod
    def load(cls, folder: Path, model: PrismForCausalLM) -> FitState:
        state = cls(model)
        folder = saved_folder(folder)
        if not folder.exists():
            return state
        with np.load(folder / "arrays.npz") as arrays:
            state.curvature.load({k: arrays[k] for k in ("coactivation", "output_moment", "prob_sum", "n_tokens")})
            state.sequences = {k: arrays[f"seq_{k}"].tolist() for k in cls.SEQUENCE_FIELDS}
        meta = json.loads((folder / "state.json").read_text())
        state.docs_seen, state.docs_bytes = meta["docs_seen"], meta["docs_bytes"]
        state.chunks, state.complete = meta["chunks"], meta["complete"]
        return state


def work_folder(db: Path) -> Path:
    return db.with_name(db.name + ".attribution")


def token_files(work: Path, model: PrismForCausalLM, grads: GradientCache | None) -> TokenFiles:
    return TokenFiles(work / "tokens", model.d_model, model.config.top_k,
                      0 if grads is None else len(grads.modules) * grads.rank)


class Progress:
    """What the job is doing, for a process that cannot open the database while the job writes it (DuckDB lets
    one process write a file and no other read it meanwhile): progress_file(db) holds {"phase", "done", "total",
    "eta_s", "pid", "time"}, replaced atomically at every chunk. eta_s is this phase's rate in this process
    extrapolated, None until a chunk has been timed. The app's first-start build reads it (app/training_data.py)."""

    def __init__(self, db: Path | None) -> None:
        self.path = None if db is None else progress_file(db)
        self._start: dict[str, tuple[float, int]] = {}

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        if self.path is None:
            return
        now = time.time()
        t0, done0 = self._start.setdefault(phase, (now, done))
        eta = None
        if total is not None and done > done0 and now > t0:
            eta = round((now - t0) / (done - done0) * max(0, total - done), 1)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"phase": phase, "done": int(done), "total": total, "eta_s": eta,
                                   "pid": os.getpid(), "time": now}))
        os.replace(tmp, self.path)


NO_PROGRESS = Progress(None)


def kept_tokens_folder(db: Path) -> Path:
    return Path(db).with_name(Path(db).name + ".attribution-tokens")


def write_exact_store(model: PrismForCausalLM, files: TokenFiles, offsets: np.ndarray, n_rows: int, folder: Path,
                      run_id: str, output_vectors: torch.Tensor, sequences_per_chunk: int,
                      progress: Progress = NO_PROGRESS) -> None:
    """The exact store from the fit pass's token files: every sequence's exact gradient rows (as the vectors pass
    computes them, before whitening and projection) rotated by Q_S (output_vectors, the factors' own), float16
    with a float32 scale per row, their prototype ids and each sequence's row offsets, as .npy files the app
    memory-maps, each row's entries (token position, activation, predicted token: what the app's panel
    highlights), and meta.json naming the run they belong to. Written atomically (replacing_folder)."""
    n_sequences = len(offsets) - 1
    d = int(output_vectors.shape[0])
    with replacing_folder(folder) as tmp:
        rows = np.lib.format.open_memmap(tmp / "rows.npy", "w+", np.float16, (n_rows, d))
        scales = np.zeros(n_rows, np.float32)
        prototypes = np.zeros(n_rows, np.int32)
        row_sequence = np.zeros(n_rows, np.int64)
        entries: dict[str, list[np.ndarray]] = {name: [] for name in EXACT_ENTRY_ARRAYS}
        at = 0
        for lo in tqdm(range(0, n_sequences, sequences_per_chunk), desc="attribution: exact store", unit="chunk"):
            part = _rows_for(model, files, offsets, lo, min(lo + sequences_per_chunk, n_sequences))
            n = len(part.rows)
            if at + n > n_rows:
                raise RuntimeError(f"the exact store found more rows than the {n_rows} cached vectors")
            rows[at: at + n], scales[at: at + n] = ExactStore.encode(part.rows, output_vectors)
            prototypes[at: at + n] = part.prototype.numpy()
            row_sequence[at: at + n] = part.sequence.numpy()
            entries["entry_counts"].append(part.offsets.diff().numpy().astype(np.int32))
            entries["entry_positions"].append(part.entry_position.numpy().astype(np.int32))
            entries["entry_activations"].append(part.entry_activation.numpy().astype(np.float32))
            entries["entry_targets"].append(part.entry_target.numpy().astype(np.int32))
            at += n
            progress("exact store", min(lo + sequences_per_chunk, n_sequences), n_sequences)
        if at != n_rows:
            raise RuntimeError(f"the exact store found {at} rows, the cache holds {n_rows} vectors")
        rows.flush()
        del rows
        np.save(tmp / "scales.npy", scales)
        np.save(tmp / "prototypes.npy", prototypes)
        np.save(tmp / "offsets.npy", np.searchsorted(row_sequence, np.arange(n_sequences + 1)).astype(np.int64))
        for name, parts in entries.items():  # the panel's highlighting: where each row's prototype was active
            np.save(tmp / f"{name}.npy", np.concatenate(parts) if parts else np.zeros(0, np.int32))
        (tmp / "meta.json").write_text(json.dumps({"format": EXACT_FORMAT, "run_id": run_id, "n_rows": n_rows,
                                                   "n_sequences": n_sequences, "d_model": d}))


def _keep_tokens(db: Path, work: Path, state: FitState, d_model: int, top_k: int) -> None:
    """The keep_tokens hook: move the token files to kept_tokens_folder(db) with what they hold (meta.json last)."""
    kept = kept_tokens_folder(db)
    shutil.rmtree(kept, ignore_errors=True)
    (work / "tokens").rename(kept)
    (kept / "meta.json").write_text(json.dumps({"n_tokens": state.n_tokens, "n_sequences": state.n_sequences,
                                                "d_model": d_model, "top_k": top_k}))


# ----------------------------------------------------------------------------------------------------------------
# Pass 1: fit.


@torch.no_grad()
def _process_windows(model: PrismForCausalLM, windows: list[Window], state: FitState, files: TokenFiles,
                     pad_id: int, grads: GradientCache | None = None) -> None:
    B, T = len(windows), max(len(w.ids) for w in windows)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, w in enumerate(windows):
        input_ids[b, : len(w.ids)] = torch.from_numpy(w.ids.astype(np.int64))
        mask[b, : len(w.ids)] = 1
    captured: dict[str, torch.Tensor] = {}
    handle = None
    if grads is not None:  # the states entering the trained layers, from the same forward pass
        def grab(module, args, kwargs):
            captured["states"] = (args[0] if args else kwargs["hidden_states"]).detach()
        handle = model.decoder_layers()[grads.start_layer].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        z, _ = model.final_states(input_ids, attention_mask=mask)  # (B, T, d)
    finally:
        if handle is not None:
            handle.remove()
    stats = token_statistics(model, z, next_token_targets(input_ids, mask))
    factors = None
    if grads is not None:
        # the trained layers' inputs and output gradients at every target token, projected (prism/grad_cache.py):
        # backward from the states' loss gradient e = W^T (softmax - onehot) the statistics hold already
        output_grad = torch.zeros(B, T, z.shape[-1])
        output_grad[stats.sequence, stats.position] = stats.e
        factors = grads.position_factors(input_ids, captured["states"], mask, output_grad, stats.sequence,
                                         stats.position)
    offset = state.n_sequences
    files.append(stats, offset, factors)
    state.curvature.add(stats)
    n_targets = torch.bincount(stats.sequence, minlength=B)
    losses = torch.zeros(B, dtype=torch.float64).index_add_(0, stats.sequence, stats.loss.double())
    for b, w in enumerate(windows):
        seq = state.sequences
        seq["doc_index"].append(w.doc_index)
        seq["seq_token_start"].append(w.seq_start)
        seq["seq_token_end"].append(w.seq_start + len(w.ids))
        seq["char_start"].append(int(w.offsets[0, 0]))
        seq["char_end"].append(int(w.offsets[-1, 1]))
        seq["n_targets"].append(int(n_targets[b]))
        seq["loss"].append(float(losses[b]))


def run_fit(model: PrismForCausalLM, tokenizer, documents, args: AttributionArgs, work: Path,
            hooks: JobHooks = NO_HOOKS, progress: Progress = NO_PROGRESS,
            grads: GradientCache | None = None) -> FitState:
    """Pass 1, resumable: every training window once through the model (and, with grads, its trained layers'
    projected gradient factors per token)."""
    state = FitState.load(work / "fit", model)
    files = token_files(work, model, grads)
    files.truncate(state.n_tokens)
    docs_file = work / "docs.jsonl"
    with docs_file.open("ab") as f:
        f.truncate(state.docs_bytes)
    if state.complete:
        return state
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    progress("fit", state.n_sequences, args.max_sequences)
    bar = tqdm(desc="attribution: fit", unit="seq", initial=state.n_sequences, total=args.max_sequences)
    chunk: list[Window] = []
    chunk_docs = 0

    def flush() -> None:
        for lo in range(0, len(chunk), args.batch_size):
            _process_windows(model, chunk[lo: lo + args.batch_size], state, files, pad_id, grads)
            progress("fit", state.n_sequences, args.max_sequences)  # per batch: a chunk can be the whole pass
        bar.update(len(chunk))
        state.chunks += 1
        hooks.kill("fit", state.chunks)
        state.docs_bytes = docs_file.stat().st_size
        state.save(work / "fit")

    for position, doc in enumerate(documents):
        if position < state.docs_seen:
            continue
        if args.limit is not None and position >= args.limit:
            break
        room = None if args.max_sequences is None else args.max_sequences - state.n_sequences - len(chunk)
        if room is not None and room <= 0:
            break
        if args.holdout and is_validation(doc.doc_id, args.holdout):  # not a training document
            continue
        windows, n_tokens = document_windows(position, doc.text, tokenizer, args.seq_len)
        windows = [w for w in windows if len(w.ids) >= 2][:room]
        if windows:
            row = {"doc_index": position, "doc_id": doc.doc_id, "source": doc.source, "url": doc.url,
                   "title": doc.title, "text": doc.text, "sha256": doc.sha256, "n_chars": len(doc.text),
                   "n_tokens": n_tokens}
            with docs_file.open("a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
        chunk.extend(windows)
        chunk_docs += 1
        state.docs_seen = position + 1
        if chunk_docs == args.docs_per_chunk:
            flush()
            chunk, chunk_docs = [], 0
    if chunk_docs:
        flush()
    bar.close()
    state.complete = True
    state.save(work / "fit")
    if state.n_sequences == 0:
        raise ValueError("the corpus gave no training sequence (every document is shorter than two tokens)")
    return state


# ----------------------------------------------------------------------------------------------------------------
# Passes 2 and 3: factors, vectors.


def _sequence_token_ranges(state: FitState) -> np.ndarray:
    """(n_sequences + 1,) offsets of each sequence's tokens in the token files."""
    offsets = np.zeros(state.n_sequences + 1, np.int64)
    offsets[1:] = np.cumsum(state.sequences["n_targets"])
    return offsets


def _rows_for(model: PrismForCausalLM, files: TokenFiles, offsets: np.ndarray, lo: int, hi: int) -> SequenceRows:
    """Exact sparse rows G_{s,i} of sequences [lo, hi) from the work files."""
    t = files.read(int(offsets[lo]), int(offsets[hi]), ("z", "e", "ids", "acts", "seq", "pos", "y"))
    n = len(t["z"])
    stats = TokenStats(z=torch.from_numpy(t["z"].copy()), e=torch.from_numpy(t["e"].copy()), m=torch.zeros(n, 0),
                       prototype_ids=torch.from_numpy(t["ids"].astype(np.int64)),
                       activations=torch.from_numpy(t["acts"].copy()),
                       sequence=torch.from_numpy(t["seq"][:, 0].astype(np.int64)),
                       position=torch.from_numpy(t["pos"][:, 0].astype(np.int64)),
                       target=torch.from_numpy(t["y"][:, 0].astype(np.int64)), loss=torch.zeros(n),
                       prob_sum=torch.zeros(0))
    return sequence_gradients(model.prototypes.weight, stats)


def _factor_rows(name: str, matrix: np.ndarray) -> list[tuple[str, int, np.ndarray]]:
    matrix = np.atleast_2d(np.asarray(matrix, np.float32))
    return [(name, i, row) for i, row in enumerate(matrix)]


def _write_factors(con, model, tokenizer, state: FitState, work: Path, args: AttributionArgs,
                   files: TokenFiles, offsets: np.ndarray) -> None:
    """Pass 2: curvature, projection basis; documents, sequences and factors in one transaction."""
    curvature = state.curvature.finish(model.lm_head.weight, args.damping)
    whitening = curvature.block_whitening()
    d = model.d_model
    rank = d if args.rank == 0 or args.rank >= d else args.rank
    moment = torch.zeros(d, d, dtype=torch.float64)
    if rank < d:
        for lo in tqdm(range(0, state.n_sequences, args.sequences_per_chunk), desc="attribution: basis"):
            rows = _rows_for(model, files, offsets, lo, min(lo + args.sequences_per_chunk, state.n_sequences))
            w = whitening(rows.prototype, rows.softmax_part(model.lm_head.weight)).double()
            moment += w.T @ w
    basis = whitened_basis(moment, rank)  # (d, r)
    docs = [json.loads(line) for line in (work / "docs.jsonl").read_text(encoding="utf-8").splitlines()]
    doc_id_of = {d["doc_index"]: d["doc_id"] for d in docs}
    seq = state.sequences
    sequences = pa.table({
        "sequence_id": np.arange(state.n_sequences, dtype=np.int32),
        "doc_id": [doc_id_of[i] for i in seq["doc_index"]],
        **{k: np.asarray(seq[k], np.int32) for k in ("seq_token_start", "seq_token_end", "char_start", "char_end",
                                                      "n_targets")},
        "loss": np.asarray(seq["loss"], np.float64)})
    documents = pa.Table.from_pylist([{k: v for k, v in d.items() if k != "doc_index"} for d in docs])
    factors = (_factor_rows("coactivation", curvature.coactivation.numpy())
               + _factor_rows("output_vectors", curvature.output_vectors.numpy())
               + _factor_rows("output_values", curvature.output_values.numpy())
               + _factor_rows("basis", basis.numpy()) + _factor_rows("damping", [[curvature.damping]]))
    with transaction(con):
        for table in ("attribution_documents", "attribution_sequences", "attribution_factors", "attribution_vectors"):
            con.execute(f"DELETE FROM {table}")  # names from the schema module
        for name, frame in (("attribution_documents", documents), ("attribution_sequences", sequences)):
            con.register("incoming", frame)
            columns = ", ".join(frame.column_names)
            con.execute(f"INSERT INTO {name} ({columns}) SELECT {columns} FROM incoming")
            con.unregister("incoming")
        frame = pa.table({"name": [f[0] for f in factors], "row": pa.array([f[1] for f in factors], pa.int32()),
                          "values": pa.array([f[2] for f in factors], pa.list_(pa.float32()))})
        con.register("incoming", frame)
        con.execute('INSERT INTO attribution_factors SELECT name, row, "values" FROM incoming')
        con.unregister("incoming")
        set_progress(con, NAME, "phase", "vectors")
        set_progress(con, NAME, "next_sequence", "0")


def _write_vectors(con, model, index_parts: tuple[BlockWhitening, torch.Tensor], state: FitState,
                   args: AttributionArgs, files: TokenFiles, offsets: np.ndarray, hooks: JobHooks = NO_HOOKS,
                   progress: Progress = NO_PROGRESS) -> int:
    """Pass 3: the cached vectors, chunk by chunk, each chunk committed with its progress."""
    whitening, basis = index_parts
    start = int(get_progress(con, NAME, "next_sequence", "0"))
    written = 0
    bar = tqdm(desc="attribution: vectors", unit="seq", initial=start, total=state.n_sequences)
    for chunk_number, lo in enumerate(range(start, state.n_sequences, args.sequences_per_chunk), start=1):
        hi = min(lo + args.sequences_per_chunk, state.n_sequences)
        rows = _rows_for(model, files, offsets, lo, hi)
        vectors = (whitening(rows.prototype, rows.softmax_part(model.lm_head.weight)) @ basis).numpy()  # (n, r)
        offs = pa.array(rows.offsets.numpy().astype(np.int32))
        frame = pa.table({
            "prototype_id": rows.prototype.numpy().astype(np.int32),
            "sequence_id": rows.sequence.numpy().astype(np.int32),
            "vector": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1), pa.float32()),
                                                        vectors.shape[1]).cast(pa.list_(pa.float32())),
            "token_positions": pa.ListArray.from_arrays(offs, pa.array(rows.entry_position.numpy().astype(np.int32))),
            "activations": pa.ListArray.from_arrays(offs, pa.array(rows.entry_activation.numpy(), pa.float32())),
            "target_ids": pa.ListArray.from_arrays(offs, pa.array(rows.entry_target.numpy().astype(np.int32))),
        })
        with transaction(con):
            con.register("incoming", frame)
            con.execute("INSERT INTO attribution_vectors SELECT prototype_id, sequence_id, vector, token_positions, "
                        "activations, target_ids FROM incoming")
            con.unregister("incoming")
            set_progress(con, NAME, "next_sequence", str(hi))
        written += len(frame)
        bar.update(hi - lo)
        progress("vectors", hi, state.n_sequences)
        hooks.kill("vectors", chunk_number)
    bar.close()
    return written


def run(db: str | Path, model: PrismForCausalLM, tokenizer, documents, args: AttributionArgs, job_args: dict,
        overwrite: bool = False, hooks: JobHooks = NO_HOOKS) -> dict | None:
    """Run (or resume) the attribution job into the database; None when it is already built with these
    arguments. `documents` is a re-iterable of precompute.corpus.Document in a deterministic order."""
    db = Path(db)
    work = work_folder(db)
    con = connect(db)
    try:
        stored = asdict(args)
        for name in ("holdout", "grad_rank"):  # caches built before these options existed keep their arguments
            if not stored[name]:
                del stored[name]
        status = start_job(con, NAME, {**job_args, **stored}, overwrite=overwrite)
        if status == "done":
            logger.info("attribution already built with these arguments in %s", db)
            shutil.rmtree(work, ignore_errors=True)
            return None
        if status == "new":
            shutil.rmtree(work, ignore_errors=True)
            for stale in (kept_tokens_folder(db), exact_folder(db), gradient_folder(db)):  # an earlier build's
                shutil.rmtree(stale, ignore_errors=True)
        model.eval()
        progress = Progress(db)
        grads = gradient_cache_for(model, args)
        state = run_fit(model, tokenizer, documents, args, work, hooks, progress, grads)
        files = token_files(work, model, grads)
        offsets = _sequence_token_ranges(state)
        if get_progress(con, NAME, "phase") != "vectors":
            progress("factors", 0, 1)
            _write_factors(con, model, tokenizer, state, work, args, files, offsets)
        factors = load_factors(con)
        parts = index_parts(factors)
        written = _write_vectors(con, model, parts, state, args, files, offsets, hooks, progress)
        n_rows = con.execute("SELECT count(*) FROM attribution_vectors").fetchone()[0]
        write_exact_store(model, files, offsets, n_rows, exact_folder(db), job_run_id(con, NAME),
                          parts[0].output_vectors, args.sequences_per_chunk, progress)
        if grads is not None:
            write_gradient_store(grads, files, state.n_sequences, state.n_tokens, gradient_folder(db),
                                 job_run_id(con, NAME), progress, hooks)
        with transaction(con):
            finish_job(con, NAME)
        progress("done", state.n_sequences, state.n_sequences)
        summary = {"sequences": state.n_sequences, "tokens": state.n_tokens,
                   "rows": con.execute("SELECT count(*) FROM attribution_vectors").fetchone()[0],
                   "rows_this_run": written, "rank": int(factors["basis"].shape[1]),
                   "gradient_rank": 0 if grads is None else grads.rank}
        if hooks.keep_tokens:
            _keep_tokens(db, work, state, model.d_model, model.config.top_k)
    finally:
        con.close()
    shutil.rmtree(work, ignore_errors=True)
    logger.info("attribution: %s", summary)
    return summary


def add_arguments(parser: argparse.ArgumentParser, shared: bool = False) -> None:
    """The job's flags. shared=True: only those `python -m precompute build` does not already have (seq-len,
    batch-size, docs-per-chunk and limit come from the evidence flags there, so both jobs cut the same windows)."""
    if not shared:
        cli.add_dataclass_arguments(parser, AttributionArgs, ("seq_len", "batch_size", "docs_per_chunk", "limit"))
    cli.add_dataclass_arguments(parser, AttributionArgs, ("rank", "damping", "max_sequences", "holdout", "grad_rank"),
                                prefix="attribution_")
    # the chunk size keeps its short flag, --attribution-chunk
    chunk = next(f for f in dataclasses.fields(AttributionArgs) if f.name == "sequences_per_chunk")
    parser.add_argument("--attribution-chunk", type=int, default=chunk.default, help=chunk.metadata["help"])


def attribution_args(ns: argparse.Namespace) -> AttributionArgs:
    return AttributionArgs(seq_len=ns.seq_len, batch_size=ns.batch_size, docs_per_chunk=ns.docs_per_chunk,
                           limit=ns.limit, max_sequences=ns.attribution_max_sequences, rank=ns.attribution_rank,
                           damping=ns.attribution_damping, sequences_per_chunk=ns.attribution_chunk,
                           holdout=ns.attribution_holdout, grad_rank=ns.attribution_grad_rank)


def run_job(context: Context) -> dict | None:
    """The job interface (precompute/inputs.py)."""
    model, tokenizer, _ = context.inputs.model()
    documents, _ = context.inputs.corpus()
    return run(context.inputs.db, model, tokenizer, documents, context.args, context.inputs.identity(),
               overwrite=context.overwrite, hooks=context.hooks)


JOB = Job(NAME, AttributionArgs, run_job, args_from=attribution_args)
