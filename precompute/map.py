"""The map job: a 2-D layout of the prototype bank for the app's map of prototypes (docs/DESIGN.md section 5).

A prototype's direction decides where it activates (a = ReLU(cos(z, p_i)), docs/DESIGN.md section 1), so the layout is
of directions: UMAP with the cosine metric on the (K, d) bank, random_state=seed (single-threaded, so the same
seed gives the same map), n_neighbors = min(15, K - 1).

Fallback, documented: with fewer than UMAP_MIN_PROTOTYPES prototypes, or method='pca', the map is the first two
principal components of the L2-normalised vectors (numpy SVD, each component's sign fixed so that its largest
loading is positive; deterministic). A neighbour graph on a handful of points says nothing, and UMAP's spectral
initialisation needs clearly more points than neighbours. prototype_map.method records which one was used.

    python -m precompute.map --db out.duckdb --model runs/prism/final [--method umap|pca] [--seed 0]

    from precompute import map as proto_map
    proto_map.run(con, model.prototypes.weight.detach().float().numpy(), seed=0)
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import warnings
from dataclasses import dataclass

import duckdb
import numpy as np
import pyarrow as pa

from precompute.inputs import Context, Inputs, Job
from precompute.runs import JobArgsMismatch, finish_job, start_job
from prism import cli

logger = logging.getLogger("precompute.map")

NAME = "map"  # the job's row in `runs`, its tables in schema.JOB_TABLES
METHODS = ("umap", "pca")
UMAP_MIN_PROTOTYPES = 16
N_NEIGHBORS = 15
_CHUNK_VIEW = "map_rows"


def pca_2d(vectors: np.ndarray) -> np.ndarray:
    """First two principal components of the L2-normalised rows. (K, d) -> (K, 2) float64."""
    x = _normalise(vectors)  # (K, d)
    x = x - x.mean(axis=0, keepdims=True)
    coords = np.zeros((len(x), 2))
    if len(x) < 2:
        return coords
    _, _, vt = np.linalg.svd(x, full_matrices=False)  # vt (r, d)
    for j in range(min(2, len(vt))):
        component = vt[j] * (1.0 if vt[j][np.argmax(np.abs(vt[j]))] >= 0 else -1.0)  # a fixed sign
        coords[:, j] = x @ component
    return coords


def umap_2d(vectors: np.ndarray, seed: int = 0) -> np.ndarray:
    """UMAP (cosine) of the rows, deterministic for a seed. (K, d) -> (K, 2) float64."""
    import umap  # imported here: numba compiles on first import

    n_neighbors = min(N_NEIGHBORS, len(vectors) - 1)
    reducer = umap.UMAP(n_components=2, n_neighbors=n_neighbors, metric="cosine", random_state=seed, n_jobs=1)
    with warnings.catch_warnings():  # "n_jobs overridden by random_state": single-threaded is what we ask for
        warnings.simplefilter("ignore", UserWarning)
        return np.asarray(reducer.fit_transform(_normalise(vectors)), dtype=np.float64)


def layout(vectors: np.ndarray, method: str = "umap", seed: int = 0) -> tuple[np.ndarray, str]:
    """(coordinates (K, 2), the method used): UMAP, or PCA when asked or when K < UMAP_MIN_PROTOTYPES."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    vectors = np.asarray(vectors, dtype=np.float32)
    if vectors.ndim != 2 or not len(vectors):
        raise ValueError(f"prototype vectors must be a non-empty (K, d) array, got shape {vectors.shape}")
    if not np.isfinite(vectors).all():
        raise ValueError("prototype vectors hold NaN or infinite values")
    if method == "umap" and len(vectors) < UMAP_MIN_PROTOTYPES:
        logger.info("map: %d prototypes are too few for UMAP (< %d); using PCA", len(vectors), UMAP_MIN_PROTOTYPES)
        method = "pca"
    coords = umap_2d(vectors, seed) if method == "umap" else pca_2d(vectors)
    return coords, method


def _normalise(vectors: np.ndarray) -> np.ndarray:
    v = np.asarray(vectors, dtype=np.float64)
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)


def fingerprint(vectors: np.ndarray) -> str:
    """sha256 (16 hex) of the float32 bank: the map is refused for another model without --overwrite."""
    v = np.ascontiguousarray(vectors, dtype=np.float32)
    return hashlib.sha256(str(v.shape).encode() + v.tobytes()).hexdigest()[:16]


def run(con: duckdb.DuckDBPyConnection, prototype_vectors: np.ndarray, seed: int = 0, overwrite: bool = False,
        method: str = "umap") -> int:
    """Lay out the (K, d) prototype bank in 2-D and write prototype_map (prototype_id = row index); returns the
    rows written (0 when already done with these arguments)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    vectors = np.asarray(prototype_vectors, dtype=np.float32)
    if vectors.ndim != 2:
        raise ValueError(f"prototype vectors must be a (K, d) array, got shape {vectors.shape}")
    args = {"method": method, "seed": seed, "n_prototypes": int(vectors.shape[0]), "d_model": int(vectors.shape[1]),
            "vectors_sha256": fingerprint(vectors)}
    if start_job(con, NAME, args, overwrite) == "done":
        logger.info("map: already done with these arguments")
        return 0
    coords, used = layout(vectors, method, seed)  # (K, 2)
    table = pa.table({"prototype_id": pa.array(np.arange(len(coords), dtype=np.int32)),
                      "x": pa.array(coords[:, 0]), "y": pa.array(coords[:, 1]),
                      "method": pa.array([used] * len(coords), pa.string())})
    con.execute("BEGIN TRANSACTION")
    try:
        con.execute("DELETE FROM prototype_map")
        con.register(_CHUNK_VIEW, table)
        try:
            con.execute(f"INSERT INTO prototype_map SELECT prototype_id, x, y, method FROM {_CHUNK_VIEW}")
        finally:
            con.unregister(_CHUNK_VIEW)
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    finish_job(con, NAME)
    logger.info("map: %d prototypes laid out with %s", len(coords), used)
    return len(coords)


@dataclass
class MapArgs:
    method: str = "umap"  # umap, or pca (also what umap falls back to below UMAP_MIN_PROTOTYPES prototypes)
    seed: int = 0  # UMAP's random_state


def run_job(context: Context) -> int:
    """The job interface (precompute/inputs.py): the layout of the model's prototype bank."""
    return run(context.inputs.connection(), context.inputs.prototype_vectors(), seed=context.args.seed,
               overwrite=context.overwrite, method=context.args.method)


JOB = Job(NAME, MapArgs, run_job, args_from=lambda ns: MapArgs(seed=ns.seed))


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("python -m precompute.map", __doc__)
    parser.add_argument("--db", required=True, help="the precompute DuckDB file")
    parser.add_argument("--model", required=True, help="a PRISM model folder (PrismForCausalLM.save_pretrained)")
    parser.add_argument("--method", choices=METHODS, default="umap",
                        help=f"umap (PCA below {UMAP_MIN_PROTOTYPES} prototypes) or pca")
    parser.add_argument("--seed", type=int, default=0, help="UMAP random_state")
    parser.add_argument("--overwrite", action="store_true", help="replace a map made with other arguments")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = cli.parse(parser, argv)
    with (cli.expected_errors(parser, JobArgsMismatch, ValueError, FileNotFoundError),
          Inputs(args.db, model=args.model) as inputs):
        written = JOB.run(Context(inputs, MapArgs(method=args.method, seed=args.seed), args.overwrite))
        methods = inputs.connection().execute("SELECT DISTINCT method FROM prototype_map").fetchall()
    used = ", ".join(m for (m,) in methods) or "-"
    print(f"map: wrote {written} rows ({used})")  # noqa: T201 - the command's output
    return written


if __name__ == "__main__":
    main()
