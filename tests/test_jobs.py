"""The precompute job interface (precompute/inputs.py, precompute/jobs.py): one registry, every job a name, an
arguments dataclass and run(context), holding exactly the jobs the schema knows, in build order."""

from __future__ import annotations

import dataclasses

import pytest

from precompute import schema
from precompute.__main__ import build_parser, main
from precompute.jobs import REGISTRY


def test_the_registry_holds_every_job_of_the_schema_in_build_order():
    assert set(REGISTRY) == set(schema.JOBS)
    assert list(REGISTRY)[0] == "evidence"  # every later job reads what it wrote
    # the passes over the corpus: the evidence and its bands (the same pass, ranked another way)
    assert [name for name, job in REGISTRY.items() if job.all_ranks] == ["evidence", "bands"]
    for name, job in REGISTRY.items():
        assert job.name == name and dataclasses.is_dataclass(job.args_class) and callable(job.run)
        assert isinstance(job.args_class(), job.args_class)  # the defaults are valid arguments


def test_the_build_flags_give_every_job_its_arguments():
    ns = build_parser().parse_args(["build", "--model", "m", "--corpus", "c", "--db", "d.duckdb", "--seed", "3"])
    for job in REGISTRY.values():
        assert isinstance(job.args_from(ns), job.args_class)
    assert REGISTRY["map"].args_from(ns).seed == REGISTRY["labels"].args_from(ns).seed == 3


def test_a_bad_flag_of_a_later_job_stops_the_build_before_any_job_runs(tmp_path, capsys):
    db = tmp_path / "out.duckdb"
    with pytest.raises(SystemExit) as exit_info:
        main(["build", "--model", str(tmp_path / "no-model"), "--corpus", "default", "--db", str(db),
              "--labeler", "openai"])
    assert exit_info.value.code == 2 and "--endpoint" in capsys.readouterr().err
    assert not db.exists()


def test_job_hooks_are_parsed_from_the_command_line_and_refuse_unknown_names():
    from precompute.runs import NO_HOOKS, JobHooks

    hooks = JobHooks.parse(["kill-after-chunk=3", "kill_at=fit:2", "hold-chunk-s=0.5", "keep-tokens=1"])
    assert hooks == JobHooks(kill_after_chunk=3, kill_at="fit:2", hold_chunk_s=0.5, keep_tokens=True)
    assert JobHooks.parse([]) == NO_HOOKS == JobHooks() and JobHooks.parse(["keep-tokens=0"]).keep_tokens is False
    with pytest.raises(ValueError, match="unknown hook 'kil_after_chunk'"):
        JobHooks.parse(["kil-after-chunk=3"])
    with pytest.raises(ValueError):
        JobHooks.parse(["kill-after-chunk=three"])
    hooks.kill("chunk", 2)  # not the chunk it names: nothing happens (the kill itself is checked by the
    hooks.kill("vectors", 2)  # evidence, attribution and labels resume tests, in a subprocess)
