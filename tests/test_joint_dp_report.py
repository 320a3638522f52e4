"""The joint-DP report: timing comes from the runs' results.json, Figure 1 curves
keep the trust models apart and take Table 1's epsilon = 1 cells as points."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from research.reproduce_joint_dp import Cell, append_row

from .helpers import load_example


def _report():
    return load_example("joint_dp/report.py", "jdp_report")


def _row(cell: Cell, acc: float, rounds: int = 20) -> dict:
    return {"dataset": cell.dataset, "owners": cell.owners, "method": cell.method,
            "trust": cell.trust if cell.dp else "-", "epsilon": cell.epsilon if cell.dp else "inf",
            "seeds": 1, "acc_mean": acc, "acc_std": 0.0, "records_per_user": 1, "personal_layers": "fc1",
            "local_epochs": 5, "rounds": rounds, "seconds": 1.0,
            "coupling": cell.coupling if cell.method == "joint-dp" else "-"}


def _finished(runs: Path, cell: Cell, seed: int, seconds: float, status: str = "completed") -> None:
    d = runs / cell.name / f"seed{seed}"
    d.mkdir(parents=True)
    (d / "results.json").write_text(json.dumps({"status": status, "wall_seconds": seconds}))


def test_timing_is_mean_wall_seconds_per_seed_and_per_client_round(tmp_path):
    report = _report()
    jdp = Cell("fashion-mnist", 8, "joint-dp", "local", 1.0)
    fed = Cell("fashion-mnist", 8, "fedavg")
    _finished(tmp_path, jdp, 0, 100.0)
    _finished(tmp_path, jdp, 1, 140.0)
    _finished(tmp_path, jdp, 2, 999.0, status="interrupted")  # not counted
    _finished(tmp_path, fed, 0, 80.0)
    rows = [{k: str(v) for k, v in _row(c, 0.5).items()} for c in (jdp, fed)]
    text = report.timing(rows, tmp_path)
    assert "| 8 | joint-dp | local | 2 | 120 | 0.750 |" in text  # 120 s / (8 owners x 20 rounds)
    assert "| 8 | fedavg | - | 1 | 80 | 0.500 |" in text
    assert "Row n = 8 (one seed of each cell run): 200 s" in text


def test_figure1_points_keep_trust_models_apart_and_include_table1(tmp_path):
    report = _report()
    rows = {}
    for trust in ("local", "central"):
        rows[trust] = {k: str(v) for k, v in _row(Cell("fashion-mnist", 8, "joint-dp", trust, 1.0), 0.7).items()}
    assert report._figure_point(rows["local"], 8, "joint-dp", "local")
    assert not report._figure_point(rows["local"], 8, "joint-dp", "central")
    assert not report._figure_point(rows["central"], 16, "joint-dp", "central")
    interleaved = dict(rows["local"], coupling="interleaved")
    assert not report._figure_point(interleaved, 8, "joint-dp", "local")

    append_row(tmp_path / "table1.csv", _row(Cell("fashion-mnist", 8, "joint-dp", "central", 1.0), 0.7))
    append_row(tmp_path / "figure1.csv", _row(Cell("fashion-mnist", 8, "joint-dp", "central", 2.0), 0.75))
    from research.reproduce_joint_dp import read_rows

    assert report.figure1(read_rows(tmp_path / "figure1.csv"), read_rows(tmp_path / "table1.csv"),
                          tmp_path / "figure1.png")
    assert (tmp_path / "figure1.png").stat().st_size > 0


def test_legend_names_curves_of_every_panel_once():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = _report()
    fig, axes = plt.subplots(1, 2)
    axes[0].plot([1, 2], [0.5, 0.6], label="joint-dp (central)")
    axes[1].plot([1, 2], [0.5, 0.6], label="joint-dp (central)")
    axes[1].plot([1, 2], [0.4, 0.5], label="joint-dp (local)")  # only in the second panel
    assert list(report.legend_handles(axes)) == ["joint-dp (central)", "joint-dp (local)"]
    plt.close(fig)


def test_figure1_points_table_pairs_joint_and_full_dp_sorted_by_epsilon(tmp_path):
    """One line per (n, trust, epsilon); Table 1's epsilon = 1 cell is marked T1, the
    later of two rows for a point wins and a missing method reads "not run"."""
    report = _report()
    from research.reproduce_joint_dp import read_rows

    append_row(tmp_path / "table1.csv", _row(Cell("fashion-mnist", 8, "joint-dp", "central", 1.0), 0.7))
    append_row(tmp_path / "table1.csv", _row(Cell("fashion-mnist", 8, "full-dp", "central", 1.0), 0.5))
    append_row(tmp_path / "table1.csv", _row(Cell("fashion-mnist", 8, "per-silo"), 0.6))
    for eps, acc in ((10.0, 0.81), (2.0, 0.75), (10.0, 0.8)):
        append_row(tmp_path / "figure1.csv", _row(Cell("fashion-mnist", 8, "joint-dp", "central", eps), acc))
    append_row(tmp_path / "figure1.csv", _row(Cell("fashion-mnist", 8, "full-dp", "central", 2.0), 0.55))
    lines = report.figure1_points(read_rows(tmp_path / "figure1.csv"),
                                  read_rows(tmp_path / "table1.csv")).splitlines()[2:]
    assert lines == [
        "| 8 | central | 1 | 0.7000 ± 0.0000 (1) T1 | 0.5000 ± 0.0000 (1) T1 | +0.2000 | 0.6000 |  |",
        "| 8 | central | 2 | 0.7500 ± 0.0000 (1) | 0.5500 ± 0.0000 (1) | +0.2000 | 0.6000 |  |",
        "| 8 | central | 10 | 0.8000 ± 0.0000 (1) | not run |  | 0.6000 |  |",
    ]


def _sampler():
    return load_example("joint_dp/simulation_memory.py", "jdp_memory")


def test_memory_samples_name_their_cell_and_report_the_peak_per_cell():
    sampler = _sampler()
    argv = ["/venv/bin/python3", "/venv/bin/flwr-jdp", "reproduce", "joint-dp", "--owners", "512",
            "--method", "fedavg", "--trust", "local", "--seeds", "1"]
    assert sampler.cell_of_command(argv) == ["512", "fedavg", "local", "", "", ""]
    assert sampler.is_reproduction(argv)
    argv = ["/venv/bin/python", "-m", "research.reproduce_joint_dp", "--owners", "512", "--method", "fedavg"]
    assert sampler.is_reproduction(argv) and not sampler.is_reproduction(["flwr-jdp", "calibrate"])
    assert sampler.cell_of_command(argv) == ["512", "fedavg", "", "", "", ""]
    # an option given twice counts with its last value, as argparse reads it
    argv = ["flwr-jdp", "reproduce", "joint-dp", "--epsilon", "1", "--owners", "256", "--method",
            "joint-dp", "--records-per-user", "5", "--epsilon", "3", "--personal", "conv2+fc1"]
    assert sampler.cell_of_command(argv) == ["256", "joint-dp", "", "3", "5", "conv2+fc1"]
    count, mib, _ = sampler.sample(("python",))  # this test's own process at least
    assert count >= 1 and mib > 0
    old_fields = sampler.FIELDS[:7]  # files written before m/r and personal were recorded
    samples = [dict(zip(old_fields, row, strict=True)) for row in (
        ("1", "9", "2000.0", "512", "fedavg", "local", "1"),
        ("2", "9", "2600.0", "512", "fedavg", "local", "1"),
        ("3", "3", "9000.0", "", "", "", ""),  # between two cells: not counted
        ("4", "9", "1024.0", "256", "joint-dp", "central", "1"))]
    samples += [dict(zip(sampler.FIELDS, row, strict=True)) for row in (
        ("5", "9", "3072.0", "256", "joint-dp", "central", "1", "", "fc1"),  # the defaults
        ("6", "9", "1536.0", "256", "joint-dp", "central", "3", "5", ""),
        ("7", "9", "2048.0", "128", "joint-dp", "central", "1", "", "conv2+fc1"),
        ("8", "9", "4096.0", "256", "joint-dp", "central", "1.0", "1", "fc1"),  # same cell as "1"
        ("9", "9", "1024.0", "256", "joint-dp", "central", "10", "", ""))]
    lines = _report().memory(samples).splitlines()
    assert "| 512 | fedavg | - | - | 1 | - | 2 | 2600 | 5.08 |" in lines  # no DP: trust, ε unused
    assert "| 256 | joint-dp | central | 1 | 1 | fc1 | 3 | 4096 | 16.00 |" in lines
    assert "| 256 | joint-dp | central | 3 | 5 | fc1 | 1 | 1536 | 6.00 |" in lines
    assert "| 128 | joint-dp | central | 1 | 1 | conv2+fc1 | 1 | 2048 | 16.00 |" in lines
    # epsilon sorts as a number: 10 after 3
    assert (lines.index("| 256 | joint-dp | central | 10 | 1 | fc1 | 1 | 1024 | 4.00 |")
            > lines.index("| 256 | joint-dp | central | 3 | 5 | fc1 | 1 | 1536 | 6.00 |"))
    assert len(lines) == 2 + 5  # the sample between two cells is not counted


def test_memory_sampler_refuses_a_file_with_other_columns(tmp_path, monkeypatch):
    sampler = _sampler()
    out = tmp_path / "memory_old.csv"
    out.write_text("time,processes,pss_mib,owners,method,trust,epsilon\n")
    monkeypatch.setattr(sys, "argv", ["simulation_memory.py", "--out", str(out), "--duration", "0"])
    with pytest.raises(SystemExit):
        sampler.main()
    assert out.read_text() == "time,processes,pss_mib,owners,method,trust,epsilon\n"
    new = tmp_path / "memory_new.csv"
    monkeypatch.setattr(sys, "argv", ["simulation_memory.py", "--out", str(new), "--duration", "0"])
    sampler.main()
    assert new.read_text() == ",".join(sampler.FIELDS) + "\n"


def test_table2_marks_personal_layers_counts_their_parameters_and_keeps_the_latest_row():
    report = _report()
    rows = []
    for rule, acc in (("none", 0.70), ("conv1", 0.60), ("fc1", 0.75), ("fc1", 0.77), ("conv1+conv2+fc1", 0.2),
                      ("fc1+fc2", 0.9), ("conv1+conv2+fc1+norms", 0.8)):
        method = "full-dp" if rule == "none" else "joint-dp"
        row = _row(Cell("fashion-mnist", 128, method, "central", 1.0), acc)
        rows.append({k: str(v) for k, v in dict(row, personal_layers=rule).items()})
    text = report.table2(rows)
    lines = text.splitlines()
    assert lines[0] == "| Conv1 | Conv2 | FC1 | personal params | accuracy, central noise |"
    # conv1: 16 x 1 x 5 x 5 + 16 = 416 (the paper's count); fc1: 32 x 7 x 7 x 10 + 10
    assert "| No | No | No | 0 | 0.7000 ± 0.0000 (1) |" in lines
    assert "| YES | No | No | 416 | 0.6000 ± 0.0000 (1) |" in lines
    assert "| No | No | YES | 15,690 | 0.7700 ± 0.0000 (1) |" in lines  # the later fc1 row
    assert "| YES | YES | YES | 28,938 | 0.2000 ± 0.0000 (1) |" in lines
    # rules never run, and the FC2-personal and GroupNorm-personal rules beyond the paper, are left out
    assert len(lines) == 2 + 4
    assert report.personal_parameter_count("fc1+fc2") == 2 * 15_690
    assert report.personal_parameter_count("conv1+fc1+fc2") == 416 + 2 * 15_690
    # shared = all 44,724 (convs 416 + 12,832, heads 2 x 15,690, GroupNorm 96) minus personal
    assert [report.shared_parameter_count(r) for r in ("fc1", "conv1+conv2+fc1", "fc1+fc2", "conv1+fc1+fc2")] == [
        29_034, 15_786, 13_344, 12_928]
    # with the GroupNorm parameters personal too, only FC2 is shared
    assert report.shared_parameter_count("conv1+conv2+fc1+norms") == 15_690


def test_table4_has_one_line_per_records_per_user_bolds_dp_above_per_silo_and_falls_back_to_table1():
    report = _report()
    rows = []
    for cell, acc in ((Cell("fashion-mnist", 256, "per-silo"), 0.70),
                      (Cell("fashion-mnist", 256, "full-dp", "central", 1.0, 1), 0.72),
                      (Cell("fashion-mnist", 256, "joint-dp", "central", 1.0, 1), 0.65),
                      (Cell("fashion-mnist", 256, "joint-dp", "central", 1.0, 1), 0.74),
                      (Cell("fashion-mnist", 256, "joint-dp", "central", 8.0, 5), 0.60)):
        row = dict(_row(cell, acc), records_per_user=cell.records_per_user)
        rows.append({k: str(v) for k, v in row.items()})
    table1 = [{k: str(v) for k, v in _row(cell, acc).items()}
              for cell, acc in ((Cell("fashion-mnist", 256, "per-silo"), 0.50),  # table 4's own wins
                                (Cell("fashion-mnist", 256, "fedavg"), 0.83))]
    lines = report.table4(rows, table1).splitlines()
    assert lines[0].startswith("| data set | n | trust | m/r | per-silo | without DP (FedAvg) | full-DP ε=1 |")
    assert lines[2] == ("| fashion-mnist | 256 | central | 1 | 0.7000 ± 0.0000 (1) | 0.8300 ± 0.0000 (1) | "
                        "**0.7200 ± 0.0000 (1)** | **0.7400 ± 0.0000 (1)** | not run | not run | not run | not run |")
    assert lines[3] == ("| fashion-mnist | 256 | central | 5 |  |  | not run | not run | not run | "
                        "0.6000 ± 0.0000 (1) | not run | not run |")
    assert len(lines) == 4


def test_table4_gives_cells_run_with_a_user_batch_their_own_block():
    """A row run with a validation-chosen user batch never takes the place of the
    default cell of the same m/r; it is shown in a block of its own."""
    report = _report()
    rows = []
    for cell, acc in ((Cell("fashion-mnist", 4, "per-silo"), 0.88),
                      (Cell("fashion-mnist", 4, "joint-dp", "local", 1.0, 10), 0.13),
                      (Cell("fashion-mnist", 4, "joint-dp", "local", 1.0, 10, user_batch=32), 0.70),
                      (Cell("fashion-mnist", 4, "full-dp", "local", 1.0, 10, user_batch=32), 0.40)):
        row = dict(_row(cell, acc), records_per_user=cell.records_per_user, user_batch_size=f"{cell.user_batch:g}")
        rows.append({k: str(v) for k, v in row.items()})
    lines = report.table4(rows, []).splitlines()
    assert lines[2] == ("| fashion-mnist | 4 | local | 10 | 0.8800 ± 0.0000 (1) | not run | not run | "
                        "0.1300 ± 0.0000 (1) | not run | not run | not run | not run |")
    assert lines[3] == ("| fashion-mnist | 4 | local, 32 users/batch | 10 | 0.8800 ± 0.0000 (1) | not run | "
                        "0.4000 ± 0.0000 (1) | 0.7000 ± 0.0000 (1) | not run | not run | not run | not run |")
    assert len(lines) == 4
    assert report._overridden(rows[2]) and not report._overridden(rows[1])


def test_table4_gives_cells_run_with_a_chosen_learning_rate_their_own_block():
    """A row run with a validation-chosen shared learning rate never replaces the
    default cell of the same m/r; its block's trust column names the rate."""
    report = _report()
    rows = []
    for cell, acc in ((Cell("fashion-mnist", 256, "joint-dp", "local", 1.0, 10), 0.51),
                      (Cell("fashion-mnist", 256, "joint-dp", "local", 1.0, 10, lr=0.0125), 0.60)):
        row = dict(_row(cell, acc), records_per_user=cell.records_per_user,
                   learning_rate=f"{cell.learning_rate:g}")
        rows.append({k: str(v) for k, v in row.items()})
    lines = report.table4(rows, []).splitlines()
    assert lines[2].startswith("| fashion-mnist | 256 | local | 10 | not run | not run | not run | 0.5100 ± 0.0000 (1) |")
    assert lines[3].startswith("| fashion-mnist | 256 | local, lr 0.0125 | 10 | not run | not run | not run | "
                               "0.6000 ± 0.0000 (1) |")
    assert len(lines) == 4
    assert report._overridden(rows[1]) and not report._overridden(rows[0])


def test_table1_joint_dp_cell_is_fc1_personal_and_other_rules_get_their_own_table():
    """A joint-DP run with more layers personal never replaces Table 1's FC1 cell; the
    rule table sets it beside that cell and per-silo, with the shared parameter count."""
    report = _report()

    def row(method, acc, rule="fc1", trust="local"):
        r = _row(Cell("fashion-mnist", 256, method, trust, 1.0), acc)
        return {k: str(v) for k, v in dict(r, personal_layers=rule).items()}

    t1 = [row("per-silo", 0.70), row("joint-dp", 0.71)]
    rules = [row("joint-dp", 0.74, "conv1+conv2+fc1"), row("joint-dp", 0.76, "conv1+conv2+fc1"),
             row("joint-dp", 0.50, "conv1+conv2+fc1", trust="central")]
    line = [x for x in report.table1(t1 + rules[:1]).splitlines() if x.startswith("| fashion-mnist | 256")][0]
    assert line.split(" | ")[5] == "0.7100 ± 0.0000 (1)"  # joint-DP local: the FC1 row
    lines = report.personal_rule_table(rules, t1).splitlines()
    # 44,724 parameters in all, 28,938 of them personal under this rule
    assert ("| 256 | local | conv1+conv2+fc1 | 15,786 | 0.05 | 0.05 | 0 | none | 0 | 0.7600 ± 0.0000 (1) | 0.7100 ± 0.0000 (1) "
            "| 0.7000 ± 0.0000 (1) | 0.7000 ± 0.0000 (1) |  |") in lines
    assert any(x.startswith("| 256 | central | conv1+conv2+fc1 | 15,786 | 0.05 | 1 | 0 | none | 0 | 0.5000") and "not run" in x
               for x in lines)
    assert len(lines) == 2 + 2


def test_validation_chosen_personal_lr_and_moving_average_get_their_own_line_paired_by_seed(tmp_path):
    """FC1 personal with another personal learning rate and a moving average is not
    Table 1's cell: it gets its own line, and its seeds are read from its own folder."""
    report = _report()
    tuned = Cell("fashion-mnist", 256, "joint-dp", "local", 1.0, personal_lr=0.2, ema_decay=0.8)
    silo = Cell("fashion-mnist", 256, "per-silo", "local", 1.0)
    for cell, acc in ((tuned, 0.75), (silo, 0.70)):
        d = tmp_path / cell.name / "seed0"
        d.mkdir(parents=True)
        (d / "results.json").write_text(json.dumps({"status": "completed", "final_accuracy": acc}))
    row = {k: str(v) for k, v in dict(_row(tuned, 0.75), personal_learning_rate="0.2", ema_decay="0.8").items()}
    t1 = [{k: str(v) for k, v in _row(silo, 0.70).items()},
          {k: str(v) for k, v in _row(Cell("fashion-mnist", 256, "joint-dp"), 0.71).items()}]
    assert report.cell_of(row) == tuned
    lines = report.personal_rule_table([row], t1, tmp_path).splitlines()
    assert lines[2] == ("| 256 | local | fc1 | 29,034 | 0.2 | 0.05 | 0.8 | none | 0 | 0.7500 ± 0.0000 (1) | 0.7100 ± 0.0000 (1) "
                        "| 0.7000 ± 0.0000 (1) | 0.7000 ± 0.0000 (1) | +0.0500 ± 0.0000 (1 of 1 seeds above) |")
    # the tuned row never replaces Table 1's FC1 cell
    assert report.table1(t1 + [row]).splitlines()[2].split(" | ")[5] == "0.7100 ± 0.0000 (1)"
    # nor is it a Figure 1 point (or Table 4's record-level fallback)
    assert not report._figure_point(row, 256, "joint-dp", "local")
    assert report._figure_point(t1[1], 256, "joint-dp", "local")


def test_adapted_cell_gets_its_own_line_and_round_trips_through_its_row(tmp_path):
    """A cell adapted before evaluation (finetune columns) is read back as the same
    cell, listed with its adaptation, and never taken for Table 1's FC1 cell."""
    report = _report()
    adapted = Cell("fashion-mnist", 256, "joint-dp", "local", 1.0, finetune_epochs=20, finetune_lr=0.02)
    silo = Cell("fashion-mnist", 256, "per-silo", "local", 1.0)
    row = {k: str(v) for k, v in dict(_row(adapted, 0.75), finetune_epochs="20",
                                      finetune_learning_rate="0.02").items()}
    assert report.cell_of(row) == adapted and adapted.name.endswith("-ft20-ftlr0.02")
    assert report.cell_of(dict(row, finetune_epochs="0", finetune_learning_rate="-")) == Cell(
        "fashion-mnist", 256, "joint-dp", "local", 1.0)
    t1 = [{k: str(v) for k, v in _row(silo, 0.70).items()},
          {k: str(v) for k, v in _row(Cell("fashion-mnist", 256, "joint-dp"), 0.71).items()}]
    line = report.personal_rule_table([row], t1).splitlines()[2]
    assert line.startswith("| 256 | local | fc1 | 29,034 | 0.05 | 0.05 | 0 | 20 epochs at 0.02 | 0 | 0.7500")
    assert report.table1(t1 + [row]).splitlines()[2].split(" | ")[5] == "0.7100 ± 0.0000 (1)"


def test_rule_minus_per_silo_is_paired_by_seed_over_the_seeds_both_rows_average(tmp_path):
    """The paired column subtracts per-silo's seed s from the rule's seed s, only for
    completed seeds below each row's seed count, and counts the seeds above."""
    report = _report()
    rule = Cell("fashion-mnist", 512, "joint-dp", "local", 1.0, personal="conv1+conv2+fc1")
    silo = Cell("fashion-mnist", 512, "per-silo", "local", 1.0)

    def done(cell, seed, acc, status="completed"):
        d = tmp_path / cell.name / f"seed{seed}"
        d.mkdir(parents=True)
        (d / "results.json").write_text(json.dumps({"status": status, "final_accuracy": acc}))

    for seed, (a, b) in enumerate([(0.66, 0.64), (0.63, 0.62), (0.60, 0.65)]):
        done(rule, seed, a)
        done(silo, seed, b)
    done(rule, 3, 0.99)  # a seed beyond the row's count is not paired
    done(silo, 3, 0.10)
    rows = [{k: str(v) for k, v in dict(_row(rule, 0.63), seeds=3, personal_layers=rule.personal).items()}]
    t1 = [{k: str(v) for k, v in dict(_row(silo, 0.637), seeds=3).items()}]
    line = report.personal_rule_table(rows, t1, tmp_path).splitlines()[2]
    diffs = [0.02, 0.01, -0.05]
    mean = sum(diffs) / 3
    std = (sum((d - mean) ** 2 for d in diffs) / 2) ** 0.5
    assert line.endswith(f"| {mean:+.4f} ± {std:.4f} (2 of 3 seeds above) |")
    # a failed seed drops out of the pairing
    (tmp_path / rule.name / "seed2" / "results.json").write_text(json.dumps({"status": "failed"}))
    assert report.personal_rule_table(rows, t1, tmp_path).splitlines()[2].endswith(
        "| +0.0150 ± 0.0071 (2 of 2 seeds above) |")


def test_figure1_point_minus_per_silo_pairs_a_one_seed_point_with_seed_0(tmp_path):
    """A one-seed Figure 1 point is paired with per-silo's seed 0 only, not with the
    per-silo mean over its three seeds."""
    report = _report()
    point = Cell("fashion-mnist", 64, "joint-dp", "local", 5.0)
    silo = Cell("fashion-mnist", 64, "per-silo", "local", 1.0)
    for cell, seed, acc in ((point, 0, 0.787), (silo, 0, 0.798), (silo, 1, 0.805), (silo, 2, 0.803)):
        d = tmp_path / cell.name / f"seed{seed}"
        d.mkdir(parents=True)
        (d / "results.json").write_text(json.dumps({"status": "completed", "final_accuracy": acc}))
    fig = [{k: str(v) for k, v in _row(point, 0.787).items()}]
    t1 = [{k: str(v) for k, v in dict(_row(silo, 0.802), seeds=3).items()}]
    line = report.figure1_points(fig, t1, tmp_path).splitlines()[2]
    assert line.startswith("| 64 | local | 5 | 0.7870")
    assert line.endswith("| 0.8020 | -0.0110 ± 0.0000 (0 of 1 seeds above) |")


def test_table4_takes_the_record_level_dp_cells_from_table1_where_it_has_none_and_marks_them():
    """m/r = 1 is record level: Table 1's cell at epsilon = 1 (FC1 personal) is the same
    cell, so Table 4 shows it, marked "T1", where table4.csv has no row of its own."""
    report = _report()

    def rows(*pairs):
        out = []
        for cell, acc in pairs:
            row = dict(_row(cell, acc), records_per_user=cell.records_per_user,
                       personal_layers=cell.personal)
            out.append({k: str(v) for k, v in row.items()})
        return out
    t4 = rows((Cell("fashion-mnist", 4, "joint-dp", "local", 1.0, 20), 0.61))
    t1 = rows((Cell("fashion-mnist", 4, "per-silo"), 0.88),
              (Cell("fashion-mnist", 4, "joint-dp", "local", 1.0), 0.77),
              (Cell("fashion-mnist", 4, "full-dp", "local", 1.0), 0.63),
              (Cell("fashion-mnist", 4, "full-dp", "central", 1.0), 0.99),  # another trust model
              (Cell("fashion-mnist", 4, "joint-dp", "local", 1.0, 1, "conv1"), 0.99))  # another rule
    lines = report.table4(t4, t1).splitlines()
    assert lines[2] == ("| fashion-mnist | 4 | local | 1 | 0.8800 ± 0.0000 (1) | not run | "
                        "0.6300 ± 0.0000 (1) T1 | 0.7700 ± 0.0000 (1) T1 | not run | not run | not run | not run |")
    assert lines[3] == ("| fashion-mnist | 4 | local | 20 |  |  | not run | 0.6100 ± 0.0000 (1) | not run | "
                        "not run | not run | not run |")
    assert len(lines) == 4


def test_translated_joint_dp_is_paired_with_per_silo_at_the_same_translation(tmp_path):
    """Random translation also helps per-silo training, so a joint-DP line with a
    shift is set beside, and paired by seed with, per-silo at that shift (not Table
    1's per-silo without it)."""
    report = _report()
    joint = Cell("fashion-mnist", 256, "joint-dp", personal="conv1+conv2+fc1", augment=2)
    silo_aug = Cell("fashion-mnist", 256, "per-silo", augment=2)
    silo = Cell("fashion-mnist", 256, "per-silo")
    for cell, accs in ((joint, (0.76, 0.75)), (silo_aug, (0.74, 0.76)), (silo, (0.70, 0.70))):
        for seed, acc in enumerate(accs):
            d = tmp_path / cell.name / f"seed{seed}"
            d.mkdir(parents=True)
            (d / "results.json").write_text(json.dumps({"status": "completed", "final_accuracy": acc}))

    def row(cell, accs):
        r = dict(_row(cell, sum(accs) / 2), seeds=2, personal_layers=cell.personal,
                 augment_shift=cell.augment)
        return {k: str(v) for k, v in r.items()}

    t1 = [row(silo, (0.70, 0.70)), row(Cell("fashion-mnist", 256, "joint-dp"), (0.71, 0.71))]
    rows = [row(joint, (0.76, 0.75)), row(silo_aug, (0.74, 0.76))]
    assert report.cell_of(rows[0]) == joint
    lines = report.personal_rule_table(rows, t1, tmp_path).splitlines()
    assert len(lines) == 3  # the per-silo row is a baseline, not a line of its own
    cols = lines[2].split(" | ")
    assert cols[8] == "2"
    assert cols[12] == "0.7500 ± 0.0000 (2)"  # per-silo at the same translation
    assert cols[13] == "+0.0050 ± 0.0212 (1 of 2 seeds above) |"


def test_table1_cells_at_a_chosen_learning_rate_are_listed_beside_the_default_and_not_timed_as_table1(tmp_path):
    report = _report()
    base = Cell("fashion-mnist", 8, "full-dp", "central", 1.0)
    tuned = Cell("fashion-mnist", 8, "full-dp", "central", 1.0, lr=2.0)
    _finished(tmp_path, base, 0, 100.0)
    _finished(tmp_path, tuned, 0, 40.0)
    rows = [{k: str(v) for k, v in _row(base, 0.70).items()},
            {**{k: str(v) for k, v in _row(tuned, 0.74).items()}, "learning_rate": "2"}]
    assert "| 8 | full-dp | central | 1 | 2 | 0.7400 ± 0.0000 (1) | 1 | 0.7000 ± 0.0000 (1) |" in (
        report.chosen_rate_table(rows))
    timed = report.timing(rows, tmp_path)
    assert "| 8 | full-dp | central | 1 | 100 |" in timed and "| 40 |" not in timed
    assert "Row n = 8 (one seed of each cell run): 100 s" in timed
    assert "0.7000" in report.table1(rows) and "0.7400" not in report.table1(rows)


def test_a_chosen_shared_rate_keeps_rule_table_lines_apart_and_is_shown():
    """Two central rows alike but for the shared learning rate get a line each, showing it."""
    report = _report()
    t1 = [{k: str(v) for k, v in _row(Cell("fashion-mnist", 512, "per-silo"), 0.64).items()}]
    rows = []
    for lr, acc in ((0.0, 0.72), (2.0, 0.75)):
        cell = Cell("fashion-mnist", 512, "joint-dp", "central", 1.0, personal_lr=0.025, lr=lr)
        rows.append({k: str(v) for k, v in dict(_row(cell, acc), personal_learning_rate="0.025",
                                                 learning_rate=str(lr or "")).items()})
    lines = report.personal_rule_table(rows, t1).splitlines()[2:]
    assert [x.split(" | ")[4:6] for x in lines] == [["0.025", "1"], ["0.025", "2"]]
    assert [x.split(" | ")[9] for x in lines] == ["0.7200 ± 0.0000 (1)", "0.7500 ± 0.0000 (1)"]


def test_tuning_table_counts_every_parameter_as_shared_for_full_dp():
    """tune.py rows carry the cell's default ``personal_layers`` (fc1) for every method;
    only joint DP keeps those layers out of the noise."""
    report = _report()
    base = {"dataset": "fashion-mnist", "owners": "64", "trust": "central", "epsilon": "1", "personal_layers": "fc1",
            "learning_rate": "1", "val_acc": "0.5"}
    lines = report.tuning_table([{**base, "method": "joint-dp"}, {**base, "method": "full-dp"}]).splitlines()[2:]
    assert [line.split(" | ")[-2] for line in lines] == ["29,034", "44,724"]


def test_a_zero_head_release_gets_its_own_line_and_never_replaces_table1():
    """A joint-DP row run with ``release-personal = zero-head`` is its own setting: the
    rule table names it after the rule, and Table 1's FC1 cell stays the seeded one."""
    report = _report()
    zero = Cell("fashion-mnist", 256, "joint-dp", "local", 1.0, release="zero-head")
    silo = Cell("fashion-mnist", 256, "per-silo", "local", 1.0)
    t1 = [{k: str(v) for k, v in _row(silo, 0.70).items()},
          {k: str(v) for k, v in _row(Cell("fashion-mnist", 256, "joint-dp"), 0.71).items()}]
    row = {k: str(v) for k, v in dict(_row(zero, 0.72), release_personal="zero-head").items()}
    assert report.cell_of(row) == zero and report.cell_of(t1[1]).release == "seeded"
    assert report._overridden(row) and not report._overridden(t1[1])
    lines = report.personal_rule_table([row], t1).splitlines()
    assert lines[2].startswith("| 256 | local | fc1, release with zero-head | 29,034 | 0.05 | 0.05 | 0 | none | 0 "
                               "| 0.7200 ± 0.0000 (1) | 0.7100 ± 0.0000 (1) |")
    assert report.table1(t1 + [row]).splitlines()[2].split(" | ")[5] == "0.7100 ± 0.0000 (1)"


def test_validated_rate_points_pair_each_method_at_its_chosen_rates(tmp_path):
    """Figure 1 points at validation-chosen rates: each method's latest row at chosen
    rates (epsilon = 1 from table1.csv / table1_personal.csv), its HPARAMS row where
    validation kept HPARAMS' rates; rows with other overrides stay out; the paired
    difference uses the seeds both cells finished."""
    report = _report()

    def row(cell: Cell, acc: float, seeds: int = 1, **extra) -> dict[str, str]:
        out = dict(_row(cell, acc), seeds=seeds, learning_rate=cell.learning_rate,
                   personal_learning_rate=cell.personal_learning_rate, **extra)
        return {k: str(v) for k, v in out.items()}

    joint = Cell("fashion-mnist", 512, "joint-dp", "central", 10.0, lr=2.0, personal_lr=0.00625)
    full = Cell("fashion-mnist", 512, "full-dp", "central", 10.0, lr=2.0)
    fig = [row(Cell("fashion-mnist", 512, "joint-dp", "central", 10.0), 0.70),
           row(Cell("fashion-mnist", 512, "full-dp", "central", 10.0), 0.71),
           row(joint, 0.74, seeds=2), row(full, 0.72, seeds=2),
           row(Cell("fashion-mnist", 512, "joint-dp", "central", 10.0, ema_decay=0.5), 0.99, ema_decay=0.5)]
    t1 = [row(Cell("fashion-mnist", 512, "joint-dp", "central", 1.0, lr=2.0), 0.74),
          row(Cell("fashion-mnist", 512, "full-dp", "central", 1.0), 0.70)]
    rules = [row(Cell("fashion-mnist", 512, "joint-dp", "central", 1.0, lr=2.0, personal_lr=0.00625), 0.76)]
    for cell, accs in ((joint, (0.75, 0.73)), (full, (0.70, 0.74))):
        for seed, acc in enumerate(accs):
            d = tmp_path / cell.name / f"seed{seed}"
            d.mkdir(parents=True)
            (d / "results.json").write_text(json.dumps({"status": "completed", "final_accuracy": acc}))
    lines = report.validated_rate_points(fig, t1, rules, tmp_path).splitlines()[2:]
    assert lines == [
        "| 512 | central | 1 | 0.7600 ± 0.0000 (1) T1, lr 2, plr 0.00625 | 0.7000 ± 0.0000 (1) T1, lr 1, HPARAMS "
        "| +0.0600 |  |",
        "| 512 | central | 10 | 0.7400 ± 0.0000 (2), lr 2, plr 0.00625 | 0.7200 ± 0.0000 (2), lr 2 | +0.0200 "
        "| +0.0200 ± 0.0424 (1 of 2 seeds above) |",
    ]
    # without a row at chosen rates in figure1.csv there is nothing to show
    assert len(report.validated_rate_points(fig[:2], t1, rules).splitlines()) == 2


def test_figure1_draws_the_chosen_rate_curve_only_where_figure1_has_such_points(tmp_path, monkeypatch):
    """The dash-dotted curve at validation-chosen rates joins the epsilon = 1 cell of
    table1_personal.csv to figure1.csv's points; a panel without them has none."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = _report()

    def row(cell: Cell, acc: float) -> dict[str, str]:
        out = dict(_row(cell, acc), learning_rate=cell.learning_rate,
                   personal_learning_rate=cell.personal_learning_rate)
        return {k: str(v) for k, v in out.items()}

    fig = [row(Cell("fashion-mnist", 512, "joint-dp", "central", 10.0), 0.70),
           row(Cell("fashion-mnist", 512, "joint-dp", "central", 10.0, lr=2.0, personal_lr=0.00625), 0.76),
           row(Cell("fashion-mnist", 8, "joint-dp", "central", 10.0), 0.80)]
    rules = [row(Cell("fashion-mnist", 512, "joint-dp", "central", 1.0, lr=2.0, personal_lr=0.00625), 0.75)]
    drawn = {}
    real_subplots = plt.subplots

    def spy(*args, **kwargs):
        f, axes = real_subplots(*args, **kwargs)
        drawn["axes"] = axes[0]
        return f, axes

    monkeypatch.setattr(plt, "subplots", spy)
    assert report.figure1(fig, [], tmp_path / "figure1.png", rules)
    small, large = drawn["axes"]
    label = "joint-dp (central, rates chosen on validation)"
    assert label not in small.get_legend_handles_labels()[1]
    line = [h for h, lab in zip(*large.get_legend_handles_labels(), strict=True) if lab == label][0]
    assert list(line.lines[0].get_xdata()) == [1.0, 10.0]
    assert list(line.lines[0].get_ydata()) == [0.75, 0.76]
