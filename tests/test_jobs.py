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
    assert [name for name, job in REGISTRY.items() if job.all_ranks] == ["evidence"]
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
