"""Job bookkeeping in the database: arguments stored per job, refusal of other arguments, resumable progress.

    con = connect("out.duckdb")
    state = start_job(con, "labels", {"labeler": "offline"}, overwrite=False)   # "new" | "resume" | "done"
    ... write rows and set_progress(...) in the same transaction ...
    finish_job(con, "labels")

A job whose arguments match a finished run is skipped (idempotent); one whose arguments differ is refused with
JobArgsMismatch unless overwrite=True, which clears that job's tables first.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from pathlib import Path

import duckdb
from tqdm.auto import tqdm

from precompute.schema import JOB_TABLES, create_all

logger = logging.getLogger(__name__)

# Test hook: hold each chunk's transaction open this many seconds, so a test can kill a job inside it.


class JobArgsMismatch(ValueError):
    """The database holds this job's output made with other arguments."""


def connect(path: str | Path, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """Open (and for writing, initialise) a precompute database. Read-only opening never creates anything."""
    path = Path(path)
    if read_only:
        if not path.is_file():
            raise FileNotFoundError(f"no database at {path}: build one with python -m precompute build")
        try:
            # Reading never needs other files: no read_text/read_csv/COPY/ATTACH outside this database, and the
            # setting cannot be switched back on through this connection (an app serving untrusted users uses it).
            return duckdb.connect(str(path), read_only=True,
                                  config={"enable_external_access": False, "lock_configuration": True})
        except duckdb.Error as err:
            raise ValueError(f"{path} is not a readable DuckDB database: {err}") from err
    path.parent.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect(str(path))
    create_all(con)
    return con


def canonical_args(args: dict) -> str:
    return json.dumps(args, sort_keys=True, default=str)


def start_job(con: duckdb.DuckDBPyConnection, job: str, args: dict, overwrite: bool = False) -> str:
    """Register a run of `job`; returns 'new', 'resume' (same arguments, unfinished) or 'done' (nothing to do)."""
    if job not in JOB_TABLES:
        raise ValueError(f"unknown job {job!r}; jobs are {', '.join(JOB_TABLES)}")
    args_json = canonical_args(args)
    row = con.execute("SELECT args_json, status FROM runs WHERE job = ?", [job]).fetchone()
    if row is not None:
        if row[0] == args_json and not overwrite:
            return "done" if row[1] == "done" else "resume"
        if not overwrite:
            old, new = json.loads(row[0]), json.loads(args_json)
            diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            raise JobArgsMismatch(f"the database already holds job {job!r} made with other arguments "
                                  f"({', '.join(diff)}); use --overwrite to replace it")
        clear_job(con, job)
    run_id = hashlib.sha256(f"{job}\n{args_json}".encode()).hexdigest()[:16]
    con.execute("INSERT INTO runs VALUES (?, ?, ?, 'running', ?, NULL)",
                [job, run_id, args_json, datetime.now(UTC).replace(tzinfo=None)])
    return "new"


def finish_job(con: duckdb.DuckDBPyConnection, job: str) -> None:
    con.execute("UPDATE runs SET status = 'done', finished_at = ? WHERE job = ?",
                [datetime.now(UTC).replace(tzinfo=None), job])


@contextlib.contextmanager
def transaction(con: duckdb.DuckDBPyConnection) -> Iterator[None]:
    """Everything inside commits together or not at all (a kill inside leaves nothing behind)."""
    con.execute("BEGIN TRANSACTION")
    try:
        yield
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")


def clear_job(con: duckdb.DuckDBPyConnection, job: str) -> None:
    """Delete a job's rows, progress and run record (one transaction)."""
    with transaction(con):
        for table in JOB_TABLES[job]:
            con.execute(f"DELETE FROM {table}")  # table names come from the schema module, never from input
        con.execute("DELETE FROM progress WHERE job = ?", [job])
        con.execute("DELETE FROM runs WHERE job = ?", [job])


@dataclass(frozen=True)
class JobHooks:
    """What a test (or a benchmark) asks of a job beyond its arguments, passed in (Context.hooks; on a command line
    the hidden `--hook NAME=VALUE` flag), never read from the environment, never stored with the job's output:
    kill_after_chunk  evidence: SIGKILL after chunk N, before its checkpoint;
    kill_at           attribution: "fit:N" or "vectors:N", SIGKILL after chunk N of that pass, "gradients:1"
                      halfway through writing the gradient store;
    hold_chunk_s      labels, search: hold each chunk's transaction open this long (a reader sees it open);
    keep_tokens       attribution: keep the fit pass's per-token files beside the database (bench.attribution's
                      reference level reads them)."""

    kill_after_chunk: int | None = None
    kill_at: str | None = None
    hold_chunk_s: float = 0.0
    keep_tokens: bool = False

    @classmethod
    def parse(cls, items: list[str] | None) -> JobHooks:
        """From `--hook NAME=VALUE` items (names with dashes or underscores); ValueError for an unknown name."""
        values: dict = {}
        kinds = {f.name: f.type for f in fields(cls)}
        for item in items or []:
            name, _, value = item.partition("=")
            name = name.strip().replace("-", "_")
            if name not in kinds:
                raise ValueError(f"unknown hook {name!r}: one of {', '.join(kinds)}")
            kind = kinds[name]
            values[name] = (value.strip().lower() in ("1", "true", "yes") if "bool" in kind else
                            float(value) if "float" in kind else int(value) if "int" in kind else value.strip())
        return cls(**values)

    def kill(self, kind: str, chunk: int) -> None:
        """SIGKILL this process if a hook asks for it at this point (kill_after_chunk for kind 'chunk')."""
        if (kind == "chunk" and self.kill_after_chunk == chunk) or self.kill_at == f"{kind}:{chunk}":
            os.kill(os.getpid(), signal.SIGKILL)


NO_HOOKS = JobHooks()


def add_hook_argument(parser) -> None:
    """The hidden --hook NAME=VALUE flag (repeatable) of the job commands: JobHooks.parse reads it."""
    parser.add_argument("--hook", action="append", default=[], metavar="NAME=VALUE", help=argparse.SUPPRESS)


def write_chunk(con: duckdb.DuckDBPyConnection, job: str, write: Callable[[], None], progress: str,
                hold_s: float = 0.0) -> None:
    """Run write() and record progress in ONE transaction: a killed job never keeps half a chunk. hold_s keeps the
    transaction open that long (JobHooks.hold_chunk_s, for tests of what a reader sees meanwhile)."""
    with transaction(con):
        write()
        if hold_s > 0:
            logger.info("%s: holding the chunk's transaction %.1f s (hold_chunk_s hook)", job, hold_s)
            time.sleep(hold_s)
        set_progress(con, job, "last_prototype_id", progress)


def write_in_chunks(con: duckdb.DuckDBPyConnection, job: str, todo: list[int], batch_size: int,
                    prepare: Callable[[list[int]], tuple[int, Callable[[], None]]], hold_s: float = 0.0) -> int:
    """Work through prototype ids in chunks of batch_size: prepare(chunk) computes the chunk's rows outside any
    transaction and returns (how many, write); write() then runs with the chunk's progress in one transaction
    (write_chunk). Returns the number of rows written."""
    written = 0
    with tqdm(total=len(todo), desc=job, unit="prototype") as bar:
        for start in range(0, len(todo), batch_size):
            chunk = todo[start:start + batch_size]
            n_rows, write = prepare(chunk)
            write_chunk(con, job, write, str(chunk[-1]), hold_s)
            written += n_rows
            bar.update(len(chunk))
            logger.info("%s: committed prototypes %d-%d (%d/%d)", job, chunk[0], chunk[-1], start + len(chunk),
                        len(todo))
    return written


@contextlib.contextmanager
def replacing_folder(folder: Path) -> Iterator[Path]:
    """Write a new version of a checkpoint folder atomically: fill the empty folder this yields, and on leaving
    the block it replaces `folder` (a kill at any point leaves the old version or the new one, never a mix; read
    it back through saved_folder). An error inside the block leaves the old version in place."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    yield tmp
    old = folder.with_name(folder.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def saved_folder(folder: Path) -> Path:
    """The last complete version replacing_folder wrote: the .old copy when a kill came between its two renames."""
    old = folder.with_name(folder.name + ".old")
    return old if not folder.exists() and old.exists() else folder


def job_run_id(con: duckdb.DuckDBPyConnection, job: str) -> str | None:
    row = con.execute("SELECT run_id FROM runs WHERE job = ?", [job]).fetchone()
    return row[0] if row else None


def remaining_prototypes(con: duckdb.DuckDBPyConnection, job: str) -> list[int]:
    """Prototype ids of prototype_stats after the job's recorded progress, in id order."""
    last = get_progress(con, job, "last_prototype_id")
    rows = con.execute("SELECT prototype_id FROM prototype_stats WHERE prototype_id > ? ORDER BY prototype_id",
                       [int(last) if last is not None else -(2**31)]).fetchall()
    return [r[0] for r in rows]


def job_args(con: duckdb.DuckDBPyConnection, job: str) -> dict | None:
    row = con.execute("SELECT args_json FROM runs WHERE job = ?", [job]).fetchone()
    return json.loads(row[0]) if row else None


def job_done(con: duckdb.DuckDBPyConnection, job: str) -> bool:
    row = con.execute("SELECT status FROM runs WHERE job = ?", [job]).fetchone()
    return bool(row and row[0] == "done")


def get_progress(con: duckdb.DuckDBPyConnection, job: str, key: str, default: str | None = None) -> str | None:
    row = con.execute("SELECT value FROM progress WHERE job = ? AND key = ?", [job, key]).fetchone()
    return row[0] if row else default


def set_progress(con: duckdb.DuckDBPyConnection, job: str, key: str, value: str) -> None:
    """Record progress; call inside the transaction that writes the rows it accounts for."""
    con.execute("INSERT OR REPLACE INTO progress VALUES (?, ?, ?)", [job, key, value])
