"""The validation tuner's grid: clipping norms join the grid, old tuning tables gain
the column with the value their runs used, finished points are not run again, and
a grid point forwards its hyperparameters to the simulation (the simulation itself
is exercised by the reproduce tests)."""

from __future__ import annotations

import sys

import pytest

from research.reproduce_joint_dp import read_rows

from .helpers import load_example

OLD_HEADER = ("dataset,owners,method,trust,epsilon,personal_layers,coupling,validation_fraction,"
              "learning_rate,personal_learning_rate,noise_multiplier,final_epsilon,val_acc,seconds\n")


def _tune():
    return load_example("joint_dp/tune.py", "jdp_tune")


def _old_table(path):
    path.write_text(OLD_HEADER
                    + "fashion-mnist,8,joint-dp,local,1,fc1,decoupled,0.1,0.05,0.05,31.1,0.99,0.6279,665.2\n"
                    + "fashion-mnist,8,fedavg,-,inf,fc1,-,0.1,0.05,0.05,0.0,0.0,0.7,10.0\n")


def test_old_table_gains_the_clipping_norm_its_runs_used(tmp_path):
    tune = _tune()
    table = tmp_path / "tuning.csv"
    _old_table(table)
    rows = tune.upgrade_table(table)
    assert [r["clipping_norm"] for r in rows] == ["1", ""]  # HPARAMS: C = 1 for DP cells
    assert [r["ema_decay"] for r in rows] == ["0", "0"]  # no moving average before the key
    assert [(r["records_per_user"], r["user_batch_size"]) for r in rows] == [("1", "0")] * 2  # record level
    assert [(r["finetune_epochs"], r["finetune_learning_rate"]) for r in rows] == [("0", "-")] * 2  # none
    assert [r["seed"] for r in rows] == ["0", "0"]  # the only seed tuned before the column
    assert [r["augment_shift"] for r in rows] == ["0", "0"]  # no translation before the key
    assert [r["validation_source"] for r in rows] == ["carve", "carve"]  # the only source before the key
    assert [r["release_personal"] for r in rows] == ["seeded", "seeded"]  # the only values before the key
    assert table.read_text().splitlines()[0].endswith(",clipping_norm,ema_decay,records_per_user,user_batch_size,"
                                                      "finetune_epochs,finetune_learning_rate,seed,augment_shift,"
                                                      "validation_source,release_personal")
    assert read_rows(table) == rows and tune.upgrade_table(table) == rows  # idempotent


def _main(tune, monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", ["tune.py", *args])
    return tune.main()


def test_finished_points_are_skipped_and_new_clipping_norms_are_run(tmp_path, monkeypatch, capsys):
    tune = _tune()
    _old_table(tmp_path / "tuning.csv")
    calls, seeds = [], []

    sources = []

    def fake_run_seed(cell, seed, data_dir, work_dir, supernodes, validation_fraction, validation_source, extra):
        calls.append((work_dir.name, validation_fraction, dict(extra)))
        seeds.append(seed)
        sources.append(validation_source)
        return {"final_accuracy": 0.61, "final_epsilon": 0.998, "noise_multiplier": 31.1,
                "config": {"personal-coupling": "decoupled"}}

    monkeypatch.setattr(tune, "run_seed", fake_run_seed)
    common = ("--owners", "8", "--method", "joint-dp", "--out", str(tmp_path), "--learning-rates", "0.05")
    assert _main(tune, monkeypatch, *common) == 0
    assert calls == []  # lr 0.05 at the cell's C = 1 is already in the table
    assert "skip lr=0.05 personal lr=0.05 C=1" in capsys.readouterr().out

    assert _main(tune, monkeypatch, *common, "--clipping-norms", "1", "0.5") == 0
    assert calls == [("lr0.05-plr0.05-c0.5", 0.1,
                      {"learning-rate": 0.05, "personal-learning-rate": 0.05, "clipping-norm": 0.5})]
    rows = read_rows(tmp_path / "tuning.csv")
    assert rows[-1]["clipping_norm"] == "0.5" and rows[-1]["val_acc"] == "0.61"
    assert "best on validation: lr=0.05 personal lr=0.05 C=1 -> 0.6279" in capsys.readouterr().out

    calls.clear()
    assert _main(tune, monkeypatch, *common, "--ema-decays", "0", "0.8") == 0
    assert calls == [("lr0.05-plr0.05-ema0.8", 0.1,
                      {"learning-rate": 0.05, "personal-learning-rate": 0.05, "ema-decay": 0.8})]
    assert read_rows(tmp_path / "tuning.csv")[-1]["ema_decay"] == "0.8"

    # a user-level cell is another cell: its default user batch is run, not skipped
    calls.clear()
    assert _main(tune, monkeypatch, *common, "--records-per-user", "10", "--user-batch-sizes", "0", "32") == 0
    assert [c[0] for c in calls] == ["lr0.05-plr0.05", "lr0.05-plr0.05-ub32"]
    assert calls[1][2]["user-batch-size"] == 32
    assert [(r["records_per_user"], r["user_batch_size"]) for r in read_rows(tmp_path / "tuning.csv")[-2:]] == [
        ("10", "0"), ("10", "32")]
    calls.clear()
    assert _main(tune, monkeypatch, *common, "--records-per-user", "10", "--user-batch-sizes", "32") == 0
    assert calls == []

    # adaptation before evaluation: (epochs, rate) pairs; epochs 0 is one point, already run
    calls.clear()
    assert _main(tune, monkeypatch, *common, "--finetune-epochs", "0", "20",
                 "--finetune-learning-rates", "0.02", "0.05") == 0
    assert [c[0] for c in calls] == ["lr0.05-plr0.05-ft20-ftlr0.02", "lr0.05-plr0.05-ft20-ftlr0.05"]
    assert calls[0][2] == {"learning-rate": 0.05, "personal-learning-rate": 0.05, "finetune-epochs": 20,
                           "finetune-learning-rate": 0.02}
    assert [(r["finetune_epochs"], r["finetune_learning_rate"]) for r in read_rows(tmp_path / "tuning.csv")[-2:]] == [
        ("20", "0.02"), ("20", "0.05")]
    calls.clear()
    assert _main(tune, monkeypatch, *common, "--finetune-epochs", "20", "--finetune-learning-rates", "0.02") == 0
    assert calls == []

    # translation of the owners' own images: shift 0 is the point already run
    calls.clear()
    assert _main(tune, monkeypatch, *common, "--augment-shifts", "0", "2") == 0
    assert calls == [("lr0.05-plr0.05-aug2", 0.1,
                      {"learning-rate": 0.05, "personal-learning-rate": 0.05, "augment-shift": 2})]
    assert read_rows(tmp_path / "tuning.csv")[-1]["augment_shift"] == "2"
    calls.clear()
    assert _main(tune, monkeypatch, *common, "--augment-shifts", "2") == 0
    assert calls == []

    # the release's public personal values: seeded is the point already run
    calls.clear()
    assert _main(tune, monkeypatch, *common, "--release-personals", "seeded", "zero-head") == 0
    assert calls == [("lr0.05-plr0.05-relzero-head", 0.1,
                      {"learning-rate": 0.05, "personal-learning-rate": 0.05, "release-personal": "zero-head"})]
    assert read_rows(tmp_path / "tuning.csv")[-1]["release_personal"] == "zero-head"
    calls.clear()
    assert _main(tune, monkeypatch, *common, "--release-personals", "zero-head") == 0
    assert calls == []

    # a second validation seed is another point: run once, recorded with its seed, then skipped
    calls.clear()
    seeds.clear()
    assert _main(tune, monkeypatch, *common, "--seed", "1") == 0
    assert [c[0] for c in calls] == ["lr0.05-plr0.05"] and seeds == [1]
    assert read_rows(tmp_path / "tuning.csv")[-1]["seed"] == "1"
    assert _main(tune, monkeypatch, *common, "--seed", "1") == 0
    assert seeds == [1]

    # a validation split from the unused pool is another point, in its own run folder,
    # and the best point is chosen among points of the same source only
    calls.clear()
    sources.clear()
    assert _main(tune, monkeypatch, *common, "--validation-source", "pool") == 0
    assert [c[0] for c in calls] == ["lr0.05-plr0.05-valpool"] and sources == ["pool"]
    assert read_rows(tmp_path / "tuning.csv")[-1]["validation_source"] == "pool"
    assert "best on validation: lr=0.05 personal lr=0.05 C=1 -> 0.6100" in capsys.readouterr().out
    assert _main(tune, monkeypatch, *common, "--validation-source", "pool") == 0
    assert sources == ["pool"]


@pytest.mark.parametrize("args", [("--method", "fedavg", "--clipping-norms", "1"),
                                  ("--method", "joint-dp", "--clipping-norms", "0"),
                                  ("--method", "joint-dp", "--ema-decays", "1"),
                                  ("--method", "joint-dp", "--user-batch-sizes", "32"),
                                  ("--method", "fedavg", "--user-batch-sizes", "32", "--records-per-user", "2"),
                                  ("--method", "joint-dp", "--user-batch-sizes", "-1", "--records-per-user", "2"),
                                  ("--method", "full-dp", "--finetune-epochs", "5"),
                                  ("--method", "joint-dp", "--finetune-epochs", "-1"),
                                  ("--method", "joint-dp", "--finetune-learning-rates", "0"),
                                  ("--method", "per-silo", "--augment-shifts", "9"),
                                  ("--method", "full-dp", "--release-personals", "zero-head"),
                                  ("--method", "joint-dp", "--release-personals", "zeros")])
def test_bad_grid_values_fail_at_start(tmp_path, monkeypatch, capsys, args):
    tune = _tune()
    with pytest.raises(SystemExit):
        _main(tune, monkeypatch, "--owners", "8", "--out", str(tmp_path), "--learning-rates", "0.05", *args)
    assert args[2] in capsys.readouterr().err
