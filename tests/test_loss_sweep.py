"""bench.loss_sweep on a tiny model: every row is what prism.eval gives for that point against the dense baseline
on the same held-out blocks, the weights reach the trained models, and running the sweep again reuses its work."""

from __future__ import annotations

import json

import pytest
from helpers import tiny_backbone_dir, write_corpus

from bench.loss_sweep import choose, main
from prism import PrismForCausalLM
from prism.eval import main as eval_main


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    backbone = str(tiny_backbone_dir(root / "bb"))
    corpus = str(write_corpus(root / "c", n_docs=60))
    common = ["--backbone", backbone, "--corpus", corpus, "--cache-dir", str(root / "cache"), "--mode", "top",
              "--n-layers", "1", "--n-prototypes", "16", "--top-k", "4", "--steps", "6", "--seq-len", "32",
              "--batch-size", "4", "--init-tokens", "200", "--val-fraction", "0.2", "--max-tokens", "2000"]
    argv = ["--out", str(root / "out"), "--r1", "0.1,1", "--r2", "0.3", "--max-val-tokens", "320", "--", *common]
    return {"root": root, "argv": argv, "result": main(argv)}


def test_rows_are_each_points_evaluation_against_the_dense_baseline(sweep):
    out = sweep["root"] / "out"
    rows = [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]
    assert [r["point"] for r in rows] == ["r1-0.1_r2-0.3", "r1-1_r2-0.3"] and sweep["result"]["points"] == 2
    for r in rows:
        folder = out / r["point"] / "final"
        config = json.loads((folder / "config.json").read_text())
        assert (config["lambda_r1"], config["lambda_r2"]) == (r["lambda_r1"], r["lambda_r2"])
        # an independent evaluation: prism.eval comparing this point with the dense baseline directly
        direct = eval_main(["--checkpoint", str(folder), "--dense", str(out / "dense" / "final"), "--no-backbone",
                            "--max-val-tokens", "320"])
        assert direct["split"]["blocks"] == 10  # 320 held-out tokens: more than the training cap keeps (400)
        assert r["ce"] == pytest.approx(direct["prism"]["ce"], rel=1e-6)
        assert r["ce_gap"] == pytest.approx(direct["prism_vs_dense_ce"], rel=1e-6, abs=1e-9)
        for name in ("r1_bar", "r2", "fve", "dead_fraction"):
            assert r[name] == pytest.approx(direct["prism"][name], rel=1e-6, abs=1e-9)
    # the two points trained different banks from the same start
    a, b = (PrismForCausalLM.from_pretrained(out / r["point"] / "final").prototypes.weight for r in rows)
    assert not a.equal(b)


def test_running_the_sweep_again_reuses_its_evaluations(sweep):
    out = sweep["root"] / "out"
    before = {p: p.stat().st_mtime_ns for p in out.rglob("eval.json")}
    assert len(before) == 3
    again = main(sweep["argv"])
    assert again == sweep["result"]
    assert {p: p.stat().st_mtime_ns for p in out.rglob("eval.json")} == before


def test_the_chosen_point_meets_the_goals_or_is_the_best_covered_within_the_ce_bound():
    def r(name, gap, r1, r2):
        return {"point": name, "ce_gap": gap, "r1_bar": r1, "r2": r2}

    rows = [r("a", 0.01, 0.95, 0.96), r("b", 0.005, 0.94, 0.97), r("c", 0.03, 0.99, 0.99), r("d", 0.0, 0.9, 0.9)]
    assert choose(rows) == (rows[1], True)
    rows = [r("a", 0.01, 0.93, 0.99), r("b", 0.015, 0.935, 0.935), r("c", 0.03, 0.99, 0.99)]
    assert choose(rows) == (rows[1], False)
    assert choose([r("c", 0.03, 0.99, 0.99)]) == (None, False)


def test_flags_the_sweep_sets_are_refused_in_the_shared_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--", "--corpus", "x", "--lambda-r1", "1"])
    assert "--lambda-r1 is set by the sweep itself" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--r1", "0.1,x", "--", "--corpus", "x"])
    assert "comma-separated" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.fixture(scope="module")
def points(tmp_path_factory):
    root = tmp_path_factory.mktemp("points")
    backbone = str(tiny_backbone_dir(root / "bb"))
    corpus = str(write_corpus(root / "c", n_docs=60))
    common = ["--backbone", backbone, "--corpus", corpus, "--cache-dir", str(root / "cache"), "--mode", "top",
              "--n-layers", "1", "--n-prototypes", "16", "--top-k", "4", "--steps", "6", "--seq-len", "32",
              "--batch-size", "4", "--init-tokens", "200", "--val-fraction", "0.2", "--max-tokens", "2000",
              "--lambda-r1", "1", "--log-every", "2"]
    argv = ["--out", str(root / "out"), "--point", "base=", "--point", "kl=--lambda-path-kl 1 --top-k 8",
            "--point", "l2=--n-layers 2 --n-prototypes 24", "--max-val-tokens", "320", "--per-source-tokens", "160",
            "--", *common]
    return {"root": root, "argv": argv, "result": main(argv)}


def test_named_points_are_each_evaluated_against_a_dense_baseline_with_their_own_dense_flags(points):
    from bench.loss_sweep import tokens_per_s

    out = points["root"] / "out"
    rows = {r["point"]: r for r in map(json.loads, (out / "sweep.jsonl").read_text().splitlines())}
    assert list(rows) == ["base", "kl", "l2"] and points["result"]["points"] == 3
    # base and kl differ only in the bank's flags: one dense baseline; l2 trains two layers, so its own
    assert sorted(points["result"]["dense"]) == ["dense", "dense_n-layers-2"]
    assert json.loads((out / "dense_n-layers-2" / "train_args.json").read_text())["n_layers"] == 2
    assert json.loads((out / "dense" / "train_args.json").read_text())["n_layers"] == 1
    assert (rows["kl"]["top_k"], rows["kl"]["lambda_path_kl"], rows["base"]["lambda_path_kl"]) == (8, 1.0, 0.0)
    assert (rows["l2"]["n_layers"], rows["l2"]["n_prototypes"]) == (2, 24)
    for name, dense in (("base", "dense"), ("kl", "dense"), ("l2", "dense_n-layers-2")):
        r = rows[name]
        direct = eval_main(["--checkpoint", str(out / name / "final"), "--dense", str(out / dense / "final"),
                            "--no-backbone", "--max-val-tokens", "320", "--per-source-tokens", "160"])
        p = direct["prism"]
        assert r["ce_gap"] == pytest.approx(direct["prism_vs_dense_ce"], rel=1e-6, abs=1e-9)
        assert r["agreement"] == pytest.approx(p["path"]["agreement"])
        assert r["margin_share"] == pytest.approx(p["path"]["margin_share_median"])
        assert r["worst_source"] == "local"
        assert r["worst_source_agreement"] == pytest.approx(p["sources"]["local"]["agreement"])
        assert r["probe_agreement"] == pytest.approx(p["probe"]["agreement"])
        assert r["speed_vs_dense"] == pytest.approx(tokens_per_s(out / name) / tokens_per_s(out / dense))
    again = main(points["argv"])  # a second run reuses every run and evaluation
    assert again == points["result"]


def test_point_arguments_are_checked(tmp_path, capsys):
    from bench.loss_sweep import dense_flags, parse_point

    assert parse_point("a.1=--top-k 8 --lambda-path-kl=2") == ("a.1", ["--top-k", "8", "--lambda-path-kl=2"])
    assert parse_point("empty=") == ("empty", [])
    assert dense_flags(["--top-k", "8", "--n-layers", "4", "--lambda-path-kl=2", "--lr", "1e-4"]) == \
        ["--n-layers", "4", "--lr", "1e-4"]
    for bad in ("noequals", "dense=--top-k 8", "a b=", "x=--out y", "x=--dense-baseline", "x='open"):
        with pytest.raises(SystemExit):
            main(["--out", str(tmp_path), "--point", bad, "--", "--corpus", "x"])
        assert "error" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--point", "a=", "--point", "a=--top-k 2", "--", "--corpus", "x"])
    assert "distinct" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_the_bars_show_each_measure_of_each_point_in_one_colour_in_both_panels():
    from bench.loss_sweep import path_bars

    def r(name, gap, agree):
        return {"point": name, "n_prototypes": 1024, "ce_gap": gap, "agreement": agree,
                "worst_source_agreement": agree - 0.1, "probe_agreement": agree - 0.2, "margin_share": 0.7,
                "min_source_margin_share": 0.5, "probe_margin_share": None}

    rows = [r("a", 0.01, 0.3), r("b", 0.005, 0.4)]
    fig = path_bars(rows)
    bars = [t for t in fig.data if t.type == "bar"]
    assert [t.name for t in bars] == ["held-out", "held-out", "worst source", "worst source", "probe", "probe"]
    assert bars[0].marker.color == bars[1].marker.color != bars[2].marker.color
    assert list(bars[0].y) == ["a (+1.00% CE)", "b (+0.50% CE)"]  # the points in the order given, with the CE gap
    assert list(bars[0].x) == [0.3, 0.4] and list(bars[1].x) == [0.7, 0.7]
    assert list(bars[4].x) == pytest.approx([0.1, 0.2])
    assert list(bars[5].x) == [None, None]  # a point without a probe shows no bar, not zero


def test_the_plot_has_one_curve_per_bank_size_in_both_panels_with_one_colour():
    from bench.loss_sweep import path_figure, path_goal_values

    def r(name, k, gap, agree):
        return {"point": name, "n_prototypes": k, "ce_gap": gap, "agreement": agree,
                "worst_source_agreement": agree - 0.1, "probe_agreement": agree - 0.2, "margin_share": 0.7,
                "min_source_margin_share": 0.5,
                "probe_margin_share": 0.4}

    rows = [r("a", 1024, 0.01, 0.3), r("b", 1024, 0.005, 0.4), r("c", 4096, 0.009, 0.5)]
    fig = path_figure(rows)
    traces = [t for t in fig.data if t.name]
    assert [t.name for t in traces] == ["K = 1024", "K = 1024", "K = 4096", "K = 4096"]
    assert traces[0].line.color == traces[1].line.color != traces[2].line.color == traces[3].line.color
    assert list(traces[0].x) == [0.5, 1.0]  # sorted by CE gap, in percent
    assert list(traces[0].y) == [path_goal_values(rows[1])[0], path_goal_values(rows[0])[0]]
    assert list(traces[0].y) == pytest.approx([0.2, 0.1])  # the lowest of overall, worst source and probe
