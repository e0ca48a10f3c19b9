"""The training-data cache built on first start: when the database the app serves has no attribution cache, the
app builds one in the background, once per machine, so the "training data behind this token" panel answers on the
first click without shipping hundreds of megabytes in assets/.

    builder = FirstStartBuild.for_database(model_folder, db)   # None: the database has a cache, or no evidence run
    builder.start()            # a child process, at low priority; returns at once
    builder.status()           # one line for the panel: how far it got, what is left
    builder.database()         # the finished cache (read-only), or None while it builds

The child is `python -m precompute build --jobs attribution` (precompute/attribution/) over the corpus the evidence
was built from, into the user's cache folder (prism.backbones.cache_dir(), beside the converted backbone), named by
the model's weights and the recipe, so another model or recipe never reads this one's cache. The job resumes where
a killed run stopped (its chunks commit with their progress), so an app stopped mid-build loses at most a chunk;
while it runs it reports progress in a file beside its database (DuckDB lets no other process open a database that
one writes). A file lock keeps two app processes on one machine from building the same cache at once: the second
waits for the first. Every other panel works meanwhile; the child runs at nice 10 so generation keeps the CPU.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

from app.database import Database
from precompute import attribution as cache
from precompute import query
from precompute.corpus import CORPORA
from precompute.inputs import file_sha256
from precompute.runs import connect
from prism.backbones import cache_dir

logger = logging.getLogger(__name__)

PHASES = {"fit": "reading the training sequences", "factors": "fitting the curvature",
          "vectors": "caching the per-sequence vectors", "exact store": "writing the exact store",
          "gradient store": "writing the gradient store", "done": "finishing"}


@dataclass(frozen=True)
class Recipe:
    """What the first-start cache is built over: issue 36 asks for >= 3,072 of the model's own training sequences
    on two cores within 15 minutes; 64-token windows are what the attribution benchmarks measure."""

    corpus: str
    max_sequences: int = 3072
    seq_len: int = 64
    holdout: float = 0.05  # prism.train's default val_fraction: its held-out documents are left out
    rank: int = 128
    batch_size: int = 8
    grad_rank: int = 16  # the gradient store (the panel's default reading); 0: none

    def argv(self) -> list[str]:
        return ["--corpus", self.corpus, "--jobs", "attribution", "--seq-len", str(self.seq_len),
                "--batch-size", str(self.batch_size), "--attribution-max-sequences", str(self.max_sequences),
                "--attribution-rank", str(self.rank), "--attribution-holdout", str(self.holdout),
                "--attribution-grad-rank", str(self.grad_rank)]


def holdout_of(model_folder: Path) -> float:
    """The validation fraction the model was trained with (train_args.json beside it), else prism.train's default."""
    try:
        return float(json.loads((Path(model_folder) / "train_args.json").read_text())["val_fraction"])
    except (OSError, ValueError, KeyError, TypeError):
        return Recipe.holdout


class ReadOnly:
    """A finished cache database, opened read-only: the part of app.database.Database the panel uses (path, run)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._con = connect(self.path, read_only=True)
        self._lock = threading.Lock()

    def run(self, fn, *args, **kwargs):
        with self._lock:
            cursor = self._con.cursor()
        try:
            return fn(cursor, *args, **kwargs)
        finally:
            cursor.close()


class FirstStartBuild:
    def __init__(self, model_folder: str | Path, recipe: Recipe, path: str | Path | None = None,
                 python: str = sys.executable, extra: tuple[str, ...] = ()) -> None:
        self.model_folder = Path(model_folder)
        self.extra = tuple(extra)  # more flags for the child (a test's --hook)
        self.recipe = recipe
        self.path = Path(path) if path is not None else self.default_path(self.model_folder, recipe)
        self.python = python
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._lock_file = None
        self._ready: ReadOnly | None = None
        self._failed: str | None = None
        self._started_at: float | None = None
        # called once with the finished cache, in a background thread (the app loads its index there, so the first
        # click does not pay for it)
        self.on_ready: list = []

    @classmethod
    def for_database(cls, model_folder: str | Path, db: Database | None) -> FirstStartBuild | None:
        """The build a served database needs: None when it has its own cache, no evidence run over a named
        corpus (precompute.corpus.CORPORA: the child reads it from installed packages), or was built for other
        weights than the model's."""
        if db is None or db.run(cache.has_attribution):
            return None
        built = db.run(query.built_from)
        if not built or built["corpus"] not in CORPORA:  # a corpus file is named by its file name only
            return None
        weights = Path(model_folder) / "model.safetensors"
        if built["weights_sha256"] and weights.is_file() and file_sha256(weights) != built["weights_sha256"]:
            logger.warning("the database was built for other weights than %s: no training-data cache is built",
                           model_folder)
            return None
        return cls(model_folder, Recipe(corpus=built["corpus"], holdout=holdout_of(model_folder)))

    @staticmethod
    def default_path(model_folder: Path, recipe: Recipe) -> Path:
        digest = hashlib.sha256()
        for f in sorted(Path(model_folder).glob("*.safetensors")):
            digest.update(file_sha256(f).encode())
        digest.update(json.dumps(asdict(recipe), sort_keys=True).encode())
        return cache_dir() / "attribution" / f"{digest.hexdigest()[:16]}.duckdb"

    def command(self) -> list[str]:
        return [self.python, "-m", "precompute", "build", "--model", str(self.model_folder), "--db", str(self.path),
                *self.recipe.argv(), *self.extra]

    @property
    def log_path(self) -> Path:
        return self.path.with_name(self.path.name + ".log")

    # -- state -----------------------------------------------------------------------------------------------

    def _open_if_built(self) -> ReadOnly | None:
        if not self.path.is_file():
            return None
        try:
            ready = ReadOnly(self.path)
        except (ValueError, FileNotFoundError):  # another process is writing it
            return None
        if ready.run(cache.has_attribution):
            return ready
        ready._con.close()
        return None

    def database(self) -> ReadOnly | None:
        """The finished cache, or None while it builds (or after a failed build)."""
        with self._lock:
            if self._ready is None and self._proc is None:
                self._ready = self._open_if_built()
            return self._ready

    def start(self) -> None:
        """Start the child unless the cache is built or another process builds it; returns at once."""
        with self._lock:
            if self._proc is not None or self._ready is not None:
                return
            self._ready = self._open_if_built()
            if self._ready is not None:
                threading.Thread(target=self._announce, args=(self._ready,), daemon=True).start()
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock = (self.path.with_name(self.path.name + ".lock")).open("a")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                lock.close()
                logger.info("another process is building the training-data cache %s", self.path)
                threading.Thread(target=self._wait_for_other, daemon=True).start()
                return
            self._lock_file, self._failed, self._started_at = lock, None, time.time()
            log = self.log_path.open("ab")
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                               os.environ.get("PYTHONPATH")]))}
            self._proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                          stdin=subprocess.DEVNULL, preexec_fn=lambda: os.nice(10))
            log.close()
            logger.info("building the training-data cache in the background (pid %d): %s", self._proc.pid,
                        " ".join(self.command()))
            atexit.register(self.stop)
            threading.Thread(target=self._wait, args=(self._proc,), daemon=True).start()

    def _wait(self, proc: subprocess.Popen) -> None:
        code = proc.wait()
        with self._lock:
            self._proc = None
            if self._lock_file is not None:
                self._lock_file.close()  # releases the flock
                self._lock_file = None
            if code == 0:
                self._ready = self._open_if_built()
            if self._ready is None:
                self._failed = (f"the training-data cache build stopped (exit code {code}); its log is "
                                f"{self.log_path}. Restart the app to resume it")
                logger.warning(self._failed)
            else:
                logger.info("training-data cache ready: %s", self.path)
        if self._ready is not None:
            self._announce(self._ready)

    def _announce(self, ready: ReadOnly) -> None:
        for callback in self.on_ready:
            try:
                callback(ready)
            except Exception:  # a warm-up that fails leaves the click to load (and report) it
                logger.exception("preparing the training-data cache failed")

    def _wait_for_other(self) -> None:
        while True:
            time.sleep(5)
            ready = self._open_if_built()
            if ready is not None:
                with self._lock:
                    self._ready = ready
                self._announce(ready)
                return

    def stop(self) -> None:
        """End the child (the app is exiting); the next start resumes where it stopped."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()

    def status(self) -> str:
        """One line: built, building (phase, how far, how long left) or failed."""
        if self.database() is not None:
            return f"Training-data cache ready ({self.recipe.max_sequences:,} training sequences)."
        if self._failed:
            return self._failed
        progress = cache.read_progress(self.path) or {}
        phase = progress.get("phase", "fit")
        done, total = progress.get("done", 0), progress.get("total") or self.recipe.max_sequences
        unit = "steps" if phase == "gradient store" else "sequences"  # three passes over its token chunks
        line = (f"Building the training-data cache on this machine, once ({PHASES.get(phase, phase)}: "
                f"{done:,} of {total:,} {unit}")
        eta = progress.get("eta_s")
        if eta is not None and phase == "fit":
            line += f", this pass about {max(1, round(eta / 60))} min more"
        return line + "). Every other panel works meanwhile."


_builds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Studio -> its FirstStartBuild


def attach(studio, build: FirstStartBuild | None) -> None:
    """Remember the studio's first-start build (the attribution panel asks builder_for)."""
    if build is None:
        _builds.pop(studio, None)
    else:
        _builds[studio] = build


def builder_for(studio) -> FirstStartBuild | None:
    return _builds.get(studio)
