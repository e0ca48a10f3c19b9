"""Command-line plumbing shared by the commands in prism/, precompute/ and bench/: a parser whose description is the
module docstring's first paragraph, one logging set-up, and expected errors (a missing file, a bad argument, a job
made with other arguments) turned into one line on stderr and exit code 2 instead of a traceback.

    from prism import cli

    def build_parser():
        parser = cli.parser("python -m prism.eval", __doc__)
        parser.add_argument("--checkpoint", required=True)
        return parser

    def main(argv=None):
        parser = build_parser()
        args = cli.parse(parser, argv)   # the flags, and logging set up
        with cli.expected_errors(parser, ValueError, FileNotFoundError):
            result = run(args)
        cli.print_json(result)       # a command whose output is JSON
        return result                # tests call main(argv) and read the result

Unexpected errors keep their traceback: only the kinds a command names are its users' mistakes.

A job's or a run's arguments are a dataclass whose fields carry their own help, and one helper makes the flags:

    @dataclass
    class RunArgs:
        steps: int = arg(1000, "optimizer steps")
        limit: int | None = arg(None, "read at most this many documents")
    add_dataclass_arguments(parser, RunArgs)        # --steps, --limit with those helps, types and defaults
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import types
import typing
from collections.abc import Iterable, Iterator
from typing import Any, NoReturn

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
FORMATTERS = {"defaults": argparse.ArgumentDefaultsHelpFormatter, "raw": argparse.RawDescriptionHelpFormatter,
              "plain": argparse.HelpFormatter}


def parser(prog: str, doc: str | None, formatter: str = "defaults", epilog: str | None = None
           ) -> argparse.ArgumentParser:
    """An ArgumentParser named as the command is typed (`python -m a.b`), described by the docstring's first
    paragraph. formatter: 'defaults' shows each flag's default, 'raw' keeps the epilog's line breaks (pass the
    whole docstring as epilog to show its usage examples), 'plain' is argparse's own."""
    return argparse.ArgumentParser(prog=prog, description=(doc or "").split("\n\n")[0], epilog=epilog,
                                   formatter_class=FORMATTERS[formatter])


def subparser(commands, name: str, help: str, formatter: str = "defaults") -> argparse.ArgumentParser:
    """A sub-command (commands = parser.add_subparsers(...)) with the same help layout as the parser."""
    return commands.add_parser(name, help=help, formatter_class=FORMATTERS[formatter])


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The first two steps of every command: parse argv (None: the process's own) and set up logging."""
    args = parser.parse_args(argv)
    setup_logging()
    return args


def setup_logging(level: int = logging.INFO) -> None:
    """Log records with time, logger name and level on stderr (stdout stays the command's output)."""
    logging.basicConfig(level=level, format=LOG_FORMAT)


def fail(parser: argparse.ArgumentParser, message: object) -> NoReturn:
    """End the command with `prog: error: message` on stderr and exit code 2 (argparse's code for bad usage)."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


@contextlib.contextmanager
def expected_errors(parser: argparse.ArgumentParser, *kinds: type[BaseException]) -> Iterator[None]:
    """Inside: an exception of one of `kinds` ends the command through fail(); any other propagates."""
    try:
        yield
    except kinds as err:
        fail(parser, err)


def print_json(result: object, indent: int | None = None) -> None:
    """The command's result as one JSON document on stdout (values JSON does not know are written as str)."""
    sys.stdout.write(json.dumps(result, indent=indent, default=str) + "\n")
    sys.stdout.flush()


def arg(default: Any, help: str, **kwargs) -> Any:
    """A dataclass field with its command-line help (add_dataclass_arguments reads it); kwargs go to field()."""
    return dataclasses.field(default=default, metadata={"help": help}, **kwargs)


def add_dataclass_arguments(parser, cls, names: Iterable[str] | None = None, required: Iterable[str] = (),
                            choices: dict[str, Iterable] | None = None, prefix: str = "") -> None:
    """One flag per field of dataclass `cls` (or per name in `names`, in that order): --field-name (after
    `prefix`), its type from the annotation (`X | None` takes an X, default None; bool is a store_true switch),
    its default the field's, its help the field's `arg(..., help)`. parser may be an argument group."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    choices = choices or {}
    for name in (names if names is not None else fields):
        f = fields[name]
        kind = hints[name]
        if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
            kind = next(k for k in typing.get_args(kind) if k is not type(None))
        default = f.default if f.default is not dataclasses.MISSING else None
        flag = "--" + (prefix + name).replace("_", "-")
        text = f.metadata.get("help", "")
        if kind is bool:
            parser.add_argument(flag, action="store_true", dest=prefix + name, help=text)
        elif name in required:
            parser.add_argument(flag, type=kind, required=True, dest=prefix + name, help=text + " (required)",
                                choices=choices.get(name))
        else:
            parser.add_argument(flag, type=kind, default=default, dest=prefix + name, help=text,
                                choices=choices.get(name))
