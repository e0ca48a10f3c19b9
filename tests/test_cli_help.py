"""Every command has --help, checked in-process (one import each instead of one Python start each): it exits 0 and
prints a usage line naming the command as it is typed. The list is read from the source, so a new command with a
main(argv) is covered without touching this file."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# lm-evaluation-harness's own command line (python -m prism.harness is lm-eval with prism registered)
OWN_USAGE = {"prism.harness"}


def commands() -> list[str]:
    """Every command as it is typed after `python -m`: a module with main(argv), or a package whose __main__.py
    has one (precompute, precompute.labels, ...)."""
    found = []
    for folder in ("prism", "precompute", "bench", "app", "recipes", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if re.search(r"^def main\(argv", path.read_text(), re.MULTILINE):
                parts = path.relative_to(ROOT).with_suffix("").parts
                found.append(".".join(parts[:-1] if parts[-1] == "__main__" else parts))
    return found


def command_module(command: str) -> str:
    """The module that holds a command's main: the package's __main__ for a package."""
    package = (ROOT / command.replace(".", "/")).is_dir()
    return f"{command}.__main__" if package else command


def test_the_list_holds_the_commands_the_readme_names():
    assert {"prism.train", "prism.eval", "precompute", "precompute.labels", "bench.behaviour_removal",
            "tools.screenshots", "recipes.release"} <= set(commands())


@pytest.mark.parametrize("module", commands())
def test_every_command_has_help(module, capsys):
    main = importlib.import_module(command_module(module)).main
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0, out
    if module not in OWN_USAGE:  # as it is typed: python -m a.b, or python a/b.py for the scripts in bench/
        typed = rf"(python -m {re.escape(module)}|python {re.escape(module.replace('.', '/'))}\.py)\b"
        assert re.search(rf"usage: {typed}", out), out[:300]
    else:
        assert "usage:" in out


def test_app_py_has_help_and_every_limit_as_a_flag(capsys):
    """app.py (a script beside the app/ package, so loaded from its file): --help, and one flag per Limits field."""
    import dataclasses
    import importlib.util

    from app.limits import Limits

    spec = importlib.util.spec_from_file_location("app_script", ROOT / "app.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "usage: python app.py" in out
    for field in dataclasses.fields(Limits):
        assert "--" + field.name.replace("_", "-") in out
    limits = script.limits_from(script.build_parser().parse_args(["--max-prompt-tokens", "64", "--no-server-paths"]))
    assert limits.max_prompt_tokens == 64 and limits.server_paths is False
    with pytest.raises(SystemExit) as exit_info:  # a bad limit: one line, exit code 2, nothing started
        script.main(["--burst", "0"])
    assert exit_info.value.code == 2 and "burst must be a positive number" in capsys.readouterr().err


def _flags_without_help(parser: argparse.ArgumentParser, prefix: str = "") -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += _flags_without_help(sub, f"{prefix}{name} ")
        elif action.dest != "help" and not (action.help or "").strip():
            missing.append(prefix + (action.option_strings[-1] if action.option_strings else action.dest))
    return missing


@pytest.mark.parametrize("module", [c for c in commands() if c not in OWN_USAGE])
def test_every_flag_says_what_it_does(module):
    """Every flag and positional argument of every command (sub-commands included) has a help text."""
    built = getattr(importlib.import_module(command_module(module)), "build_parser", None)
    if built is None:
        pytest.skip(f"{module} builds its parser inside main")
    assert _flags_without_help(built()) == []


def test_dataclass_flags_take_type_default_and_help_from_the_field():
    from prism import cli

    @dataclasses.dataclass
    class Args:
        steps: int = cli.arg(10, "optimizer steps")
        limit: int | None = cli.arg(None, "at most this many")
        rate: float = cli.arg(0.5, "a rate")
        fast: bool = cli.arg(False, "go fast")
        name: str = cli.arg("", "a name")

    parser = argparse.ArgumentParser()
    cli.add_dataclass_arguments(parser, Args, required=("name",), choices={"steps": (10, 20)})
    ns = parser.parse_args(["--name", "x", "--limit", "3", "--fast"])
    assert Args(**vars(ns)) == Args(steps=10, limit=3, rate=0.5, fast=True, name="x")
    assert isinstance(ns.limit, int) and parser.parse_args(["--name", "x"]).limit is None
    assert parser.parse_args(["--name", "x", "--rate", "2"]).rate == 2.0
    with pytest.raises(SystemExit):
        parser.parse_args([])  # --name is required
    with pytest.raises(SystemExit):
        parser.parse_args(["--name", "x", "--steps", "15"])  # not one of the choices
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["steps"] == "optimizer steps" and helps["name"] == "a name (required)"
    prefixed = argparse.ArgumentParser()
    cli.add_dataclass_arguments(prefixed, Args, ("steps",), prefix="job_")
    assert prefixed.parse_args(["--job-steps", "4"]).job_steps == 4
