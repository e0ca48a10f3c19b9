"""What the precompute jobs read, in one place, and the interface every job follows.

Inputs: the model (a folder written by PrismForCausalLM.save_pretrained with its tokenizer beside it, or the shipped
default), the corpus (a spec: 'default', a local path or a hub dataset id) with the identities stored beside every
job's output, the database, and the distributed set-up under torchrun.

    model, tokenizer, model_identity = load_model("runs/prism/final")      # or "default": assets/model
    documents, corpus_identity = load_corpus("default")                     # re-iterable, same order every pass
    setup_distributed()                                                     # gloo process group under torchrun
    windows, n_tokens = document_windows(0, doc.text, tokenizer, seq_len=256)   # the model inputs of a document

The job interface: a Job is a name, an arguments dataclass and run(context), where the Context holds the build's
shared Inputs (each loaded once), the job's arguments and --overwrite. precompute/jobs.py lists the jobs in build
order; `python -m precompute build` and each job's own command line run them through it:

    with Inputs("out.duckdb", model="runs/prism/final", corpus="default") as inputs:
        summary = search.JOB.run(Context(inputs, search.SearchArgs(), overwrite=False))

Nothing imports precompute/__main__.py.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import torch
import torch.distributed as dist

from precompute.runs import NO_HOOKS, JobHooks, add_hook_argument, connect
from prism import PrismForCausalLM, cli
from prism.backbones import load_tokenizer

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "assets" / "model"


def setup_distributed() -> None:
    """Join the process group torchrun describes (WORLD_SIZE > 1), once; a single process does nothing."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")


def rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def model_folder(spec: str) -> Path:
    """The folder a model spec names: 'default' is the shipped assets/model."""
    folder = DEFAULT_MODEL if spec == "default" else Path(spec)
    if spec == "default" and not folder.exists():
        raise FileNotFoundError(f"no default model is shipped yet ({folder}); give --model a folder written by "
                                "PrismForCausalLM.save_pretrained")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not a PRISM model folder (no config.json); "
                                "give a folder written by PrismForCausalLM.save_pretrained")
    return folder


def load_model(spec: str):
    """(model, tokenizer, identity) for a save_pretrained folder with its tokenizer beside it, or 'default'."""
    folder = model_folder(spec)
    model = PrismForCausalLM.from_pretrained(folder).eval()
    try:
        tokenizer = load_tokenizer(str(folder))
    except ValueError as err:
        raise ValueError(f"{folder} has no tokenizer saved beside the model: {err}") from err
    identity = {"path": folder.name, "weights_sha256": file_sha256(folder / "model.safetensors"),
                "n_prototypes": model.config.n_prototypes, "top_k": model.config.top_k}
    return model, tokenizer, identity


def load_corpus(spec: str):
    """(documents iterable, identity) for a corpus spec: a path, a hub dataset id or 'default'."""
    from precompute import corpus

    class Documents:  # re-iterable: every pass re-reads the source in the same order
        def __iter__(self):
            return corpus.iter_documents(spec)

    identity: dict = {"spec": spec if not Path(spec).exists() else Path(spec).name}
    if spec in corpus.CORPORA:
        identity["manifest"] = corpus.default_manifest(spec)
    elif Path(spec).exists():
        from prism.data import corpus_fingerprint

        identity["sha256"] = corpus_fingerprint(spec)
    return Documents(), identity


# ----------------------------------------------------------------------------------------------------------------
# Model inputs: the windows every job cuts a document into (the evidence job's rows and the attribution job's
# training sequences are the same windows, so both point at the same token and character spans).


@dataclass
class Window:
    doc_index: int
    seq_start: int  # token positions in the document
    ids: np.ndarray  # (L,)
    offsets: np.ndarray  # (L, 2) character offsets
    next_ids: np.ndarray  # (L,) the document's next token, -1 at its end


def document_windows(doc_index: int, text: str, tokenizer, seq_len: int) -> tuple[list[Window], int]:
    """Tokenize one document with character offsets and cut it into windows of seq_len tokens."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int32)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int32).reshape(-1, 2)
    nxt = np.concatenate([ids[1:], [-1]]).astype(np.int32)
    windows = [Window(doc_index, s, ids[s: s + seq_len], offsets[s: s + seq_len], nxt[s: s + seq_len])
               for s in range(0, len(ids), seq_len)]
    return windows, len(ids)


def encode_sequence(text: str, tokenizer, seq_token_start: int, seq_token_end: int) -> torch.Tensor:
    """The exact input sequence the job ran for a stored evidence row: (1, L) token ids."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor([ids[seq_token_start:seq_token_end]], dtype=torch.long)


# ----------------------------------------------------------------------------------------------------------------
# The job interface: every job is a name, an arguments dataclass and run(context); precompute/jobs.py lists them.


class Inputs:
    """A build's shared inputs, each loaded on first use and then kept, so every job of a build uses one model, one
    corpus and one database connection.

        with Inputs("out.duckdb", model="runs/prism/final", corpus="default") as inputs:
            model, tokenizer, identity = inputs.model()
            con = inputs.connection()      # opened (and the schema created) on first use; closed on leaving
    """

    def __init__(self, db: str | Path, model: str | None = None, corpus: str | None = None) -> None:
        self.db = Path(db)
        self.model_spec, self.corpus_spec = model, corpus
        self._model = None
        self._corpus = None
        self._con: duckdb.DuckDBPyConnection | None = None

    def __enter__(self) -> Inputs:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def model(self):
        """(model, tokenizer, identity) of the model spec (load_model)."""
        if self._model is None:
            self._model = load_model(_required(self.model_spec, "a model (--model)"))
        return self._model

    def corpus(self):
        """(documents, identity) of the corpus spec (load_corpus)."""
        if self._corpus is None:
            self._corpus = load_corpus(_required(self.corpus_spec, "a corpus (--corpus)"))
        return self._corpus

    def identity(self) -> dict:
        """What the model and corpus jobs store with their output: {"model": ..., "corpus": ...}."""
        return {"model": self.model()[2], "corpus": self.corpus()[1]}

    def prototype_vectors(self) -> np.ndarray:
        """The prototype bank (K, d) as float32: from the loaded model, else from the folder's weights alone (no
        tokenizer needed)."""
        if self._model is not None:
            model = self._model[0]
        else:
            model = PrismForCausalLM.from_pretrained(model_folder(_required(self.model_spec, "a model (--model)")))
        return model.prototypes.weight.detach().float().numpy()  # (K, d)

    def connection(self) -> duckdb.DuckDBPyConnection:
        if self._con is None:
            self._con = connect(self.db)
        return self._con

    def close(self) -> None:
        if self._con is not None:
            self._con.close()
            self._con = None


def _required(spec: str | None, what: str) -> str:
    if spec is None:
        raise ValueError(f"this job needs {what}")
    return spec


@dataclass(frozen=True)
class Context:
    """What a job runs with: the build's inputs, its own arguments, whether it may replace results that were made
    with other arguments, and the hooks passed in for tests and benchmarks."""

    inputs: Inputs
    args: Any  # the job's arguments dataclass
    overwrite: bool = False
    hooks: JobHooks = NO_HOOKS  # what a test or a benchmark asks beyond the arguments (precompute/runs.py)


@dataclass(frozen=True)
class Job:
    """A precompute job. name: its row in `runs` and its tables in schema.JOB_TABLES; args_class: its arguments
    (a dataclass, stored with its output); run(context) -> a summary (None on the ranks that do not merge);
    args_from: its arguments from `python -m precompute build`'s flags; all_ranks: it runs on every rank of a
    distributed build (the others run on rank 0, after every rank finished the all-ranks jobs)."""

    name: str
    args_class: type
    run: Callable[[Context], Any]
    args_from: Callable[[argparse.Namespace], Any]
    all_ranks: bool = False


def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --corpus, --db and --overwrite: the flags of every job that reads a model and a corpus."""
    parser.add_argument("--model", required=True, help="a folder written by PrismForCausalLM.save_pretrained with its "
                                                       "tokenizer beside it, or 'default'")
    parser.add_argument("--corpus", required=True, help="a path, a hub dataset id (id[:config]) or 'default'")
    parser.add_argument("--db", required=True, help="the DuckDB file to write")
    parser.add_argument("--overwrite", action="store_true", help="replace results made with other arguments")


def job_command(job: Job, parser: argparse.ArgumentParser, argv: list[str] | None) -> Any:
    """A model-and-corpus job's own command line (python -m precompute.evidence, python -m precompute.attribution):
    parse the flags, load the inputs (a bad flag, model or corpus ends the command with one line), join the process
    group under torchrun when the job runs on every rank, run the job."""
    add_hook_argument(parser)
    ns = cli.parse(parser, argv)
    with Inputs(ns.db, ns.model, ns.corpus) as inputs:
        with cli.expected_errors(parser, ValueError, FileNotFoundError):
            args = job.args_from(ns)
            hooks = JobHooks.parse(ns.hook)
            inputs.model()
            inputs.corpus()
        if job.all_ranks:
            setup_distributed()
        try:
            return job.run(Context(inputs, args, ns.overwrite, hooks))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
