"""Every command has --help, checked in-process (one import each instead of one Python start each): it exits 0 and
prints a usage line naming the command as it is typed. The list is read from the source, so a new command with a
main(argv) is covered without touching this file."""

from __future__ import annotations

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
