"""The joint-DP sweep driver: which cells a table holds, and when a cell counts as done."""

from __future__ import annotations

from research.reproduce_joint_dp import Cell, append_row

from .helpers import load_example


def _sweep():
    return load_example("joint_dp/sweep.py", "jdp_sweep")


def _row(cell: Cell, seeds: int) -> dict[str, str]:
    return {"dataset": cell.dataset, "owners": str(cell.owners), "method": cell.method,
            "trust": cell.trust if cell.dp else "-", "epsilon": str(cell.epsilon) if cell.dp else "inf",
            "seeds": str(seeds), "records_per_user": "1", "personal_layers": cell.personal,
            "coupling": cell.coupling if cell.method == "joint-dp" else "-"}


def test_table1_has_six_cells_per_n_under_both_trust_models():
    sweep = _sweep()
    plan = sweep.cells("1", "fashion-mnist", [4, 256], ["local", "central"])
    assert len(plan) == 12
    assert ("table1.csv", Cell("fashion-mnist", 4, "joint-dp", "central", 1.0)) in plan


def test_table2_runs_the_eight_personal_rules_at_n128_with_none_as_full_dp():
    sweep = _sweep()
    plan = sweep.cells("2", "fashion-mnist", [], ["central"])
    assert [c.personal for _, c in plan] == ["none", "conv1", "conv2", "conv1+conv2", "fc1", "conv1+fc1",
                                             "conv2+fc1", "conv1+conv2+fc1"]
    assert {c.method for _, c in plan[1:]} == {"joint-dp"} and plan[0][1].method == "full-dp"
    assert {(c.owners, c.trust, c.epsilon) for _, c in plan} == {(128, "central", 1.0)}


def test_a_cell_is_done_only_with_enough_seeds_and_the_same_configuration():
    sweep = _sweep()
    cell = Cell("fashion-mnist", 256, "joint-dp", "central", 1.0)
    one_seed = [_row(cell, 1)]
    assert sweep.done(one_seed, cell, 1)
    assert not sweep.done(one_seed, cell, 3)  # rerun: seed 0 is reused, seeds 1 and 2 run
    assert sweep.done(one_seed + [_row(cell, 3)], cell, 3)
    assert not sweep.done(one_seed, Cell("fashion-mnist", 256, "joint-dp", "local", 1.0), 1)
    assert not sweep.done(one_seed, Cell("fashion-mnist", 256, "joint-dp", "central", 2.0), 1)
    assert not sweep.done(one_seed, Cell("fashion-mnist", 256, "joint-dp", "central", 1.0, 1, "conv1"), 1)


def test_table4_takes_per_silo_and_fedavg_from_table1(tmp_path):
    sweep = _sweep()
    plan = sweep.cells("4", "fashion-mnist", [256], ["central"])
    # per-silo, FedAvg; per m/r: full DP at 1, joint DP at 1, 3, 8; then full DP at 3, 8
    assert len(plan) == 2 + 5 * 4 + 5 * 2
    assert ("table4.csv", Cell("fashion-mnist", 256, "joint-dp", "central", 8.0, 20)) in plan
    assert plan[-1] == ("table4.csv", Cell("fashion-mnist", 256, "full-dp", "central", 8.0, 20))
    silo = Cell("fashion-mnist", 256, "per-silo")
    append_row(tmp_path / "table1.csv", _row(silo, 1))
    assert sweep.done(sweep.existing_rows(tmp_path, "table4.csv", silo), silo, 1)
    full = Cell("fashion-mnist", 256, "full-dp", "central", 1.0)
    append_row(tmp_path / "table1.csv", _row(full, 1))  # a DP cell of Table 1 is not Table 4's
    assert not sweep.done(sweep.existing_rows(tmp_path, "table4.csv", full), full, 1)
