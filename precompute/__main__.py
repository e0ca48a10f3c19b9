"""Build a precompute database: evidence, labels, search embeddings, the prototype map and intervention presets,
in that order.

    python -m precompute build --model runs/prism/final --corpus default --db out.duckdb
    python -m precompute build ... --jobs evidence,labels           # a subset (later jobs read earlier ones)
    python -m precompute build ... --jobs attribution --attribution-max-sequences 4096   # opt-in: training data
    torchrun --standalone --nproc-per-node 2 -m precompute build ...  # evidence sharded by rank, merged by rank 0
    python -m precompute strip-text --db out.duckdb --out shipped.duckdb   # pointer-only copy for shipping

Every job stores its arguments in the database; running it again with the same arguments does nothing, with
other arguments it is refused unless --overwrite. A killed build resumes where it stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path

import torch.distributed as dist

from precompute import attribution, evidence
from precompute.runs import JobArgsMismatch, connect, transaction
from precompute.schema import DEFAULT_JOBS, JOBS
from prism import PrismForCausalLM
from prism.backbones import load_tokenizer

logger = logging.getLogger("precompute")

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "assets" / "model"


def setup_distributed() -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_model(spec: str):
    """(model, tokenizer, identity) for a save_pretrained folder with its tokenizer beside it, or 'default'."""
    folder = DEFAULT_MODEL if spec == "default" else Path(spec)
    if spec == "default" and not folder.exists():
        raise FileNotFoundError(f"no default model is shipped yet ({folder}); give --model a folder written by "
                                "PrismForCausalLM.save_pretrained")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not a PRISM model folder (no config.json); "
                                "give a folder written by PrismForCausalLM.save_pretrained")
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
    if spec == "default":
        identity["manifest"] = corpus.default_manifest()
    elif Path(spec).exists():
        from prism.data import corpus_fingerprint

        identity["sha256"] = corpus_fingerprint(spec)
    return Documents(), identity


def build(ns: argparse.Namespace) -> dict:
    jobs = [j.strip() for j in ns.jobs.split(",") if j.strip()]
    unknown = [j for j in jobs if j not in JOBS]
    if unknown:
        raise ValueError(f"unknown jobs {unknown}; jobs are {', '.join(JOBS)}")
    model, tokenizer, model_info = load_model(ns.model)
    documents, corpus_info = load_corpus(ns.corpus)
    summary: dict = {}
    setup_distributed()
    rank = dist.get_rank() if dist.is_initialized() else 0
    if "evidence" in jobs:
        summary["evidence"] = evidence.run(ns.db, model, tokenizer, documents, evidence.evidence_args(ns),
                                           {"model": model_info, "corpus": corpus_info}, overwrite=ns.overwrite)
    if dist.is_initialized():
        dist.barrier()
    if rank != 0:
        return summary
    if "attribution" in jobs:
        summary["attribution"] = attribution.run(ns.db, model, tokenizer, documents, attribution.attribution_args(ns),
                                                 {"model": model_info, "corpus": corpus_info}, overwrite=ns.overwrite)
    con = connect(ns.db)
    try:
        if "labels" in jobs:
            from precompute import labels

            summary["labels"] = labels.run(con, labels.make_labeler(ns.labeler, endpoint=ns.endpoint,
                                                                    model=ns.llm_model), overwrite=ns.overwrite,
                                         seed=ns.seed)
        if "search" in jobs:
            from precompute import search

            summary["search"] = search.run(con, overwrite=ns.overwrite)
        if "map" in jobs:
            from precompute import map as proto_map

            vectors = model.prototypes.weight.detach().float().numpy()
            summary["map"] = proto_map.run(con, vectors, seed=ns.seed, overwrite=ns.overwrite)
        if "presets" in jobs:
            from precompute import presets

            summary["presets"] = presets.run(con, presets.PresetArgs(), overwrite=ns.overwrite)
    finally:
        con.close()
    return summary


def strip_text(db: Path, out: Path) -> dict:
    """A pointer-only copy: document text, evidence token texts and context token texts removed; offsets, hashes
    and every statistic kept. The app reads the text back from the installed corpus and checks the hashes."""
    if out.exists():
        raise FileExistsError(f"{out} exists; choose another --out")
    tmp = out.with_name(out.name + ".partial")
    tmp.unlink(missing_ok=True)
    shutil.copyfile(db, tmp)
    con = connect(tmp)
    try:
        with transaction(con):
            con.execute("UPDATE documents SET text = NULL")
            con.execute("UPDATE attribution_documents SET text = NULL")
            con.execute("UPDATE evidence SET token = '', context_tokens = []")
            con.execute("INSERT OR REPLACE INTO meta VALUES ('pointer_only', 'true')")
        con.execute("CHECKPOINT")
        counts = {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("documents", "evidence")}
    finally:
        con.close()
    tmp.replace(out)
    return counts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m precompute", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="run the jobs into a database",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    evidence.add_arguments(b)
    b.add_argument("--jobs", default=",".join(DEFAULT_JOBS),
                   help=f"comma-separated subset of {', '.join(JOBS)} (attribution only when named)")
    attribution.add_arguments(b.add_argument_group("attribution"), shared=True)
    b.add_argument("--labeler", default="offline", choices=("offline", "offline-v1", "openai", "local"),
                   help="offline: labeler v2 (against siblings); offline-v1: the first, token-rule labeler")
    b.add_argument("--endpoint", default=None, help="OpenAI-compatible base URL for --labeler openai")
    b.add_argument("--llm-model", default=None, help="model name (openai) or local folder (local)")
    b.add_argument("--seed", type=int, default=0, help="seed of the map layout and label scores")
    s = sub.add_parser("strip-text", help="write a pointer-only copy of a database (no third-party text)")
    s.add_argument("--db", required=True)
    s.add_argument("--out", required=True)
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if ns.command == "strip-text":
            result = strip_text(Path(ns.db), Path(ns.out))
        else:
            result = build(ns)
    except (ValueError, FileNotFoundError, FileExistsError, JobArgsMismatch) as err:
        parser.error(str(err))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    json.dump(result, sys.stdout, default=str)
    sys.stdout.write("\n")
    return result


if __name__ == "__main__":
    main()
