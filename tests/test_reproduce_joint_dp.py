"""`python -m research.reproduce_joint_dp`: cells are validated, follow the paper's schedule,
and one cell runs as a Flower (Ray) simulation and appends a row to table.csv."""

import csv

import pytest

from flwr_jdp.joint_dp.config import ConfigError, parse_config
from research.reproduce_joint_dp import Cell, main, run_config, schedule_for


def test_paper_schedule_table3():
    assert schedule_for(4) == (20, 10)
    assert schedule_for(64) == (10, 10)
    assert schedule_for(512) == (5, 20)


def test_cell_run_config_matches_the_paper_setup(tmp_path):
    cfg = parse_config(run_config(Cell("fashion-mnist", 256, "joint-dp", "central", 1.0), 0,
                                  "/data", str(tmp_path)))
    assert (cfg.num_owners, cfg.local_epochs, cfg.num_rounds) == (256, 5, 20)
    assert (cfg.delta, cfg.target_epsilon, cfg.max_records, cfg.classes_per_owner) == (1e-4, 1.0, 10_000, 8)
    assert cfg.noise_placement == "central" and cfg.personal_layers == r"^fc1\."
    user = parse_config(run_config(Cell("mnist", 4, "joint-dp", "local", 3.0, 5), 0, "", str(tmp_path)))
    assert (user.privacy_unit, user.records_per_user) == ("user", 5)
    assert cfg.personal_coupling == "decoupled" and cfg.decoupled
    paper = Cell("fashion-mnist", 256, "joint-dp", coupling="interleaved")
    assert paper.name.endswith("-interleaved")
    with pytest.raises(ConfigError, match="personal-coupling.*Algorithm 1"):  # archived cells only
        parse_config(run_config(paper, 0, "/data", str(tmp_path)))


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "dp"}, "--method"),
    ({"trust": "none"}, "--trust"),
    ({"method": "joint-dp", "personal": "none"}, "full-dp"),
    ({"method": "full-dp", "epsilon": 0.0}, "--epsilon"),
    ({"coupling": "loose"}, "--coupling"),
])
def test_bad_cells_fail_with_the_option_name(kwargs, message):
    args = {"dataset": "mnist", "owners": 4, "method": "joint-dp", **kwargs}
    with pytest.raises(ValueError, match=message):
        Cell(**args)


@pytest.mark.extended  # Ray simulation: `pytest -m extended`
def test_reproduce_one_cell_through_flower_simulation(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["--dataset", "digits", "--owners", "4", "--method",
               "joint-dp", "--epsilon", "8", "--quick", "--rounds", "2", "--local-epochs", "1",
               "--out", str(out)])
    assert rc == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    with (out / "table.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 1
    row = rows[0]
    assert (row["dataset"], row["owners"], row["method"], row["trust"]) == ("digits", "4", "joint-dp", "local")
    assert float(row["epsilon"]) == 8.0 and row["seeds"] == "1"
    assert 0.0 < float(row["acc_mean"]) <= 1.0
    assert row["coupling"] == "decoupled"
    assert float(last) == pytest.approx(float(row["acc_mean"]), abs=1e-4)
    results = (out / "runs").rglob("results.json")
    assert any(results)


def test_a_finished_seed_is_reused_not_rerun(tmp_path, monkeypatch):
    """An interrupted sweep continues: a seed whose results.json says completed for
    the same configuration is returned without a new simulation; any other is run."""
    import json

    import research.simulation as simulation
    from research.reproduce_joint_dp import run_seed

    cell = Cell("digits", 4, "joint-dp", "local", 8.0)
    seed_dir = tmp_path / "runs" / cell.name / "seed0"
    seed_dir.mkdir(parents=True)
    cfg = parse_config(run_config(cell, 0, "", str(seed_dir))).to_dict()
    (seed_dir / "results.json").write_text(json.dumps(
        {"status": "completed", "config": {**cfg, "results-dir": "elsewhere"}, "final_accuracy": 0.5,
         "wall_seconds": 3.0}))
    calls = []
    monkeypatch.setattr(simulation, "simulate", lambda *a, **k: calls.append(a) or {"seconds": 0.0})
    res = run_seed(cell, 0, "", tmp_path / "runs")
    assert res["final_accuracy"] == 0.5 and res["timing"]["reused"] and not calls
    # the same data folder spelt as a relative and as an absolute path is the same configuration
    rel = Cell("digits", 4, "joint-dp", "local", 2.0)
    rel_dir = tmp_path / "runs" / rel.name / "seed0"
    rel_dir.mkdir(parents=True)
    rel_cfg = parse_config(run_config(rel, 0, str(tmp_path / "data"), str(rel_dir))).to_dict()
    (rel_dir / "results.json").write_text(json.dumps(
        {"status": "completed", "config": rel_cfg, "final_accuracy": 0.6, "wall_seconds": 3.0}))
    monkeypatch.chdir(tmp_path)
    assert run_seed(rel, 0, "data", tmp_path / "runs")["final_accuracy"] == 0.6 and not calls
    # a different configuration (more rounds) is not reused
    with pytest.raises(FileNotFoundError):
        run_seed(cell, 0, "", tmp_path / "runs2", rounds=3)
    assert len(calls) == 1


def test_rerunning_a_finished_cell_does_not_append_the_same_row_twice(tmp_path, monkeypatch):
    import json

    import research.simulation as simulation
    from research.reproduce_joint_dp import read_rows, run_cell

    cell = Cell("digits", 4, "joint-dp", "central", 3.0, 5)
    seed_dir = tmp_path / "runs" / cell.name / "seed0"
    seed_dir.mkdir(parents=True)
    cfg = parse_config(run_config(cell, 0, "", str(seed_dir))).to_dict()
    (seed_dir / "results.json").write_text(json.dumps(
        {"status": "completed", "config": cfg, "final_accuracy": 0.5, "rounds_completed": 2,
         "final_epsilon": 2.99, "wall_seconds": 3.0}))
    monkeypatch.setattr(simulation, "simulate", lambda *a, **k: pytest.fail("a finished seed was rerun"))
    first = run_cell(cell, 1, "", tmp_path, table="t.csv")
    assert run_cell(cell, 1, "", tmp_path, table="t.csv") == first
    rows = read_rows(tmp_path / "t.csv")
    assert len(rows) == 1 and rows[0]["acc_mean"] == "0.5" and rows[0]["records_per_user"] == "5"
    # a different outcome for the same cell is a new row (the report reads the latest)
    (seed_dir / "results.json").write_text(json.dumps(
        {"status": "completed", "config": cfg, "final_accuracy": 0.6, "rounds_completed": 2,
         "final_epsilon": 2.99, "wall_seconds": 3.0}))
    run_cell(cell, 1, "", tmp_path, table="t.csv")
    assert [r["acc_mean"] for r in read_rows(tmp_path / "t.csv")] == ["0.5", "0.6"]


def test_validation_chosen_overrides_name_their_own_runs_and_reach_the_run_config(tmp_path):
    base = Cell("fashion-mnist", 256, "joint-dp")
    tuned = Cell("fashion-mnist", 256, "joint-dp", personal_lr=0.2, ema_decay=0.8)
    assert tuned.name == base.name + "-plr0.2-ema0.8"  # never the folder of the default runs
    cfg = parse_config(run_config(tuned, 0, "/data", str(tmp_path)))
    assert (cfg.personal_learning_rate, cfg.ema_decay) == (0.2, 0.8)
    plain = parse_config(run_config(base, 0, "/data", str(tmp_path)))
    assert (plain.personal_learning_rate, plain.ema_decay) == (0.05, 0.0)
    # the default spelt out is the same cell (same name, same runs)
    assert Cell("fashion-mnist", 256, "joint-dp", personal_lr=0.05) == base
    for bad, option in (({"ema_decay": 1.0}, "--ema-decay"), ({"personal_lr": -1.0}, "--personal-learning-rate"),
                        ({"user_batch": -1.0}, "--user-batch-size"), ({"user_batch": 8.0}, "--user-batch-size")):
        with pytest.raises(ValueError, match=option):
            Cell("fashion-mnist", 256, "joint-dp", **bad)  # user_batch 8 at the record level: rejected


def test_a_user_batch_names_its_own_runs_and_reaches_the_run_config(tmp_path):
    user = Cell("fashion-mnist", 4, "full-dp", "central", 1.0, 10)
    batched = Cell("fashion-mnist", 4, "full-dp", "central", 1.0, 10, user_batch=32)
    assert batched.name == user.name + "-ub32"
    assert parse_config(run_config(batched, 0, "/data", str(tmp_path))).user_batch_size == 32
    assert parse_config(run_config(user, 0, "/data", str(tmp_path))).user_batch_size == 0
    with pytest.raises(ValueError, match="--user-batch-size"):
        Cell("fashion-mnist", 4, "fedavg", records_per_user=10, user_batch=32)


def test_a_shared_learning_rate_names_its_own_runs_and_reaches_the_run_config(tmp_path):
    """A validation-chosen rate for the shared parameters is its own cell (own run
    folder, ``learning_rate`` column); the HPARAMS rate spelt out is the default cell."""
    base = Cell("fashion-mnist", 256, "joint-dp", "local", 1.0, 10)
    slow = Cell("fashion-mnist", 256, "joint-dp", "local", 1.0, 10, lr=0.0125)
    assert slow.name == base.name + "-lr0.0125"
    assert parse_config(run_config(slow, 0, "/data", str(tmp_path))).learning_rate == 0.0125
    assert parse_config(run_config(base, 0, "/data", str(tmp_path))).learning_rate == 0.05
    assert Cell("fashion-mnist", 256, "joint-dp", "local", 1.0, 10, lr=0.05) == base
    assert Cell("fashion-mnist", 4, "joint-dp", "central", lr=1.0) == Cell("fashion-mnist", 4, "joint-dp", "central")
    with pytest.raises(ValueError, match="--learning-rate"):
        Cell("fashion-mnist", 256, "joint-dp", lr=-0.1)


def test_an_adapted_cell_names_its_own_runs_and_reaches_the_run_config(tmp_path):
    base = Cell("fashion-mnist", 256, "joint-dp")
    adapted = Cell("fashion-mnist", 256, "joint-dp", finetune_epochs=20, finetune_lr=0.02)
    assert adapted.name == base.name + "-ft20-ftlr0.02"
    cfg = parse_config(run_config(adapted, 0, "/data", str(tmp_path)))
    assert (cfg.finetune_epochs, cfg.finetune_learning_rate) == (20, 0.02)
    plain = parse_config(run_config(base, 0, "/data", str(tmp_path)))
    assert plain.finetune_epochs == 0
    assert Cell("fashion-mnist", 256, "joint-dp", finetune_lr=0.3) == base  # no epochs: the rate is unused
    for bad, option in (({"method": "full-dp", "finetune_epochs": 5}, "--finetune-epochs applies to joint-dp"),
                        ({"finetune_epochs": -1}, "--finetune-epochs"),
                        ({"finetune_epochs": 5, "finetune_lr": 0.0}, "--finetune-learning-rate")):
        with pytest.raises(ValueError, match=option):
            Cell("fashion-mnist", 256, **{"method": "joint-dp", **bad})


def test_a_seed_stored_before_ema_decay_and_user_batch_existed_is_still_reused(tmp_path, monkeypatch):
    import json

    import research.simulation as simulation
    from research.reproduce_joint_dp import run_seed

    cell = Cell("digits", 4, "joint-dp", "local", 8.0)
    seed_dir = tmp_path / "runs" / cell.name / "seed0"
    seed_dir.mkdir(parents=True)
    old = parse_config(run_config(cell, 0, "", str(seed_dir))).to_dict()
    del old["ema-decay"], old["user-batch-size"], old["augment-shift"], old["release-personal"]
    (seed_dir / "results.json").write_text(json.dumps(
        {"status": "completed", "config": old, "final_accuracy": 0.5, "wall_seconds": 3.0}))
    monkeypatch.setattr(simulation, "simulate", lambda *a, **k: pytest.fail("a finished seed was rerun"))
    assert run_seed(cell, 0, "", tmp_path / "runs")["final_accuracy"] == 0.5
    # with a moving average it is another configuration (and another folder)
    averaged = Cell("digits", 4, "joint-dp", "local", 8.0, ema_decay=0.5)
    assert averaged.name != cell.name
    # so is a release with the personal head at zero, which the run config carries
    zero = Cell("digits", 4, "joint-dp", "local", 8.0, release="zero-head")
    assert zero.name == cell.name + "-relzero-head"
    assert run_config(zero, 0, "", str(seed_dir))["release-personal"] == "zero-head"
    assert "release-personal" not in run_config(cell, 0, "", str(seed_dir))


@pytest.mark.parametrize("kwargs", [{"release": "zeros"}, {"method": "full-dp", "release": "zero-head"},
                                    {"coupling": "interleaved", "release": "zero-head"}])
def test_a_cell_refuses_a_release_personal_it_cannot_use(kwargs):
    with pytest.raises(ValueError, match="release-personal"):
        Cell("digits", 4, **{"method": "joint-dp", **kwargs})


def test_an_old_table_gains_the_new_columns_at_the_values_its_runs_used(tmp_path, monkeypatch):
    import json

    import research.simulation as simulation
    from research.reproduce_joint_dp import read_rows, run_cell, upgrade_table

    table = tmp_path / "t.csv"
    table.write_text("dataset,owners,method,trust,epsilon,seeds,acc_mean,acc_std,records_per_user,"
                     "personal_layers,local_epochs,rounds,seconds,coupling\n"
                     "digits,4,joint-dp,local,8.0,1,0.5,0.0,1,fc1,1,2,3.0,decoupled\n"
                     "digits,4,fedavg,-,inf,1,0.7,0.0,1,fc1,1,2,3.0,-\n")
    rows = upgrade_table(table)
    assert [(r["personal_learning_rate"], r["ema_decay"], r["user_batch_size"], r["finetune_epochs"],
             r["finetune_learning_rate"], r["learning_rate"], r["augment_shift"], r["release_personal"])
            for r in rows] == [("0.05", "0", "0", "0", "-", "0.05", "0", "seeded")] * 2
    assert read_rows(table) == rows and upgrade_table(table) == rows  # idempotent
    # a finished cell whose row is already there (in the old format) is not appended again
    cell = Cell("digits", 4, "joint-dp", "local", 8.0)
    seed_dir = tmp_path / "runs" / cell.name / "seed0"
    seed_dir.mkdir(parents=True)
    cfg = parse_config(run_config(cell, 0, "", str(seed_dir), local_epochs=1, rounds=2)).to_dict()
    (seed_dir / "results.json").write_text(json.dumps(
        {"status": "completed", "config": cfg, "final_accuracy": 0.5, "rounds_completed": 2,
         "final_epsilon": 7.9, "wall_seconds": 3.0}))
    monkeypatch.setattr(simulation, "simulate", lambda *a, **k: pytest.fail("a finished seed was rerun"))
    run_cell(cell, 1, "", tmp_path, table="t.csv", local_epochs=1, rounds=2)
    assert len(read_rows(table)) == 2


def _upgrade_in_a_process(path: str, ready, go) -> None:
    from pathlib import Path

    from research.reproduce_joint_dp import upgrade_table

    ready.set()
    go.wait()
    upgrade_table(Path(path))


def test_tables_upgraded_by_processes_side_by_side_keep_each_row_once(tmp_path):
    """Two tuning runs started together both upgrade an old table: each row must stay
    once (the table is rewritten whole and moved into place, never truncated and
    refilled while another process reads it)."""
    import multiprocessing as mp

    from research.reproduce_joint_dp import COLUMNS, read_rows

    table = tmp_path / "t.csv"
    old = "dataset,owners,method,trust,epsilon,seeds,acc_mean,acc_std,records_per_user,personal_layers\n"
    table.write_text(old + "".join(f"digits,4,fedavg,-,inf,1,0.{i:04d},0.0,1,fc1\n" for i in range(3000)))
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    readies = [ctx.Event() for _ in range(4)]
    procs = [ctx.Process(target=_upgrade_in_a_process, args=(str(table), r, go)) for r in readies]
    for p in procs:
        p.start()
    for r in readies:
        r.wait(60)
    go.set()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    rows = read_rows(table)
    assert sorted(r["acc_mean"] for r in rows) == sorted(f"0.{i:04d}" for i in range(3000))
    assert list(rows[0]) == list(COLUMNS) and not list(tmp_path.glob(".t.csv-*"))
