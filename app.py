"""PRISM studio: the Gradio app. Generate text, see every token's logit split into prototype slices, read the
evidence behind each prototype, suppress or scale prototypes and compare the texts side by side.

    python app.py                                   # the shipped default model and database (assets/)
    python app.py --model runs/m --db out.duckdb    # your own; --db is optional (no evidence without it)
    python app.py --host 0.0.0.0 --port 7860 --share
    python app.py --max-prompt-tokens 1024 --requests-per-s 5   # limits for a public app (see app/limits.py)
    python app.py --model runs/m --db out.duckdb --training-data-cache   # build its attribution cache meanwhile
    python app.py --mcp                             # also an MCP server at /gradio_api/mcp/ (app/tools.py)

With the shipped default, the first start builds the training-data cache in the background (app/training_data.py;
3,072 training sequences of 64 tokens, about 11 min on two quiet cores, once per machine, at low priority); every
other panel works meanwhile.

On a Hugging Face Space (SPACE_ID set) the controller box takes only shipped controllers and uploads, and --host
defaults to GRADIO_SERVER_NAME (the Space sets 0.0.0.0).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # never phone home


def build_parser() -> argparse.ArgumentParser:
    from prism import cli

    parser = cli.parser("python app.py", __doc__)
    parser.add_argument("--model", default=None, help="a PRISM model folder (default: the shipped assets/model)")
    parser.add_argument("--db", default=None, help="its precompute DuckDB file (default: the shipped assets/*.duckdb "
                                                   "when the default model is used)")
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME") or "127.0.0.1",
                        help="address to listen on (0.0.0.0 for a LAN; default: GRADIO_SERVER_NAME when set)")
    parser.add_argument("--port", type=int, default=None, help="port (default: 7860 or the next free one)")
    parser.add_argument("--share", action="store_true", help="also open a public gradio.live link")
    parser.add_argument("--concurrency", type=int, default=2, help="generations running at once (they share the CPU)")
    parser.add_argument("--mcp", action=argparse.BooleanOptionalAction, default=None,
                        help="also serve the app's tools (generate, explain a token, search, cards, compare, training "
                             "data) to MCP clients at /gradio_api/mcp/ (default: on on a Space, else off)")
    parser.add_argument("--training-data-cache", action=argparse.BooleanOptionalAction, default=None,
                        help="build the training-data (attribution) cache in the background when the database has "
                             "none, once per machine, into the cache folder (default: on for the shipped default)")
    from app.limits import Limits

    group = parser.add_argument_group("limits for a public app (app/limits.py)")
    for field in dataclasses.fields(Limits):
        flag = "--" + field.name.replace("_", "-")
        if field.type == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                               help=f"{Limits.HELP[field.name]} (default: on, off on a Space)")
        else:
            group.add_argument(flag, type=float if field.type == "float" else int, default=field.default,
                               metavar="N", help=Limits.HELP[field.name])
    return parser


def limits_from(args: argparse.Namespace):
    """The Limits the flags ask for; on a Space server paths are off unless --server-paths says otherwise."""
    from app.limits import Limits, on_space

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)}
    if values["server_paths"] is None:
        values["server_paths"] = not on_space()
    return Limits(**values)


def main(argv: list[str] | None = None) -> None:
    from prism import cli

    parser = build_parser()
    args = cli.parse(parser, argv)
    from app.assets import MissingModel, resolve_db, resolve_model
    from app.core import Studio
    from app.ui import build_demo, launch

    with cli.expected_errors(parser, MissingModel, ValueError):
        model = resolve_model(args.model)
        limits = limits_from(args)
    try:
        studio = Studio.load(model, resolve_db(args.db, model_given=args.model is not None), limits=limits)
    except (OSError, ValueError) as err:
        cli.fail(parser, f"cannot load the model at {model}: {err}")
    shipped = args.model is None and args.db is None
    if args.training_data_cache or (args.training_data_cache is None and shipped):
        from app import training_data

        build = training_data.FirstStartBuild.for_database(model, studio.db)
        if build is not None:
            from app.attribution import index_for

            build.on_ready.append(lambda db: index_for(studio, db))  # the first click finds the index loaded
            training_data.attach(studio, build)
            build.start()
    from app.limits import on_space

    mcp = args.mcp if args.mcp is not None else on_space()
    launch(build_demo(studio, args.concurrency), host=args.host, port=args.port, share=args.share,
           concurrency=args.concurrency, limits=limits, mcp=mcp)


if __name__ == "__main__":
    main()
