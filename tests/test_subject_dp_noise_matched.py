"""The noise-matched runs take their noise multiplier from scale.csv (the column of
their method), keep one row per (writers, match, run, rate, split, seed), and report
each method at the rate its own validation rows choose."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from .helpers import load_example


@pytest.fixture
def nm(monkeypatch):
    # the script imports its siblings (femnist.py, accounting.py) as top-level modules
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples" / "subject_dp"))
    return load_example("subject_dp/noise_matched.py", "sdp_noise_matched")


def _write(path, rows):
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_matched_noise_reads_the_method_column(tmp_path, nm):
    _write(tmp_path / "scale.csv", [
        {"writers": 300, "noise_multiplier": 52.5, "local_item_dp_noise_multiplier": 1.96,
         "subjects_per_batch": 150.0},
        {"writers": 3500, "noise_multiplier": 9.7, "local_item_dp_noise_multiplier": 0.62,
         "subjects_per_batch": 250.0}])
    assert nm.matched_noise(tmp_path / "scale.csv", 3500, "higradavg-exact") == 9.7
    assert nm.matched_noise(tmp_path / "scale.csv", 3500, "local-item-dp") == 0.62
    # snr: fewer writers per batch here (150 against 250), so less noise for the same ratio
    assert nm.matched_noise(tmp_path / "scale.csv", 3500, "higradavg-exact", "snr") == pytest.approx(9.7 * 150 / 250)
    assert nm.matched_noise(tmp_path / "scale.csv", 3500, "local-item-dp", "snr") == 0.62
    assert nm.matched_noise(tmp_path / "scale.csv", 300, "higradavg-exact", "snr") == 52.5
    with pytest.raises(SystemExit, match="1000 writers"):
        nm.matched_noise(tmp_path / "scale.csv", 1000, "local-item-dp")


def _row(run, lr, split, seed, acc, writers=3500, match="noise"):
    return {"writers_matched": writers, "match": match, "run": run, "learning_rate": lr, "evaluate_on": split,
            "seed": seed, "noise_multiplier": 9.7, "epsilon": 80.0, "unit": "subject", "rounds": 100,
            "acc_final": acc, "seconds": 1.0}


def test_write_row_replaces_only_the_same_key(tmp_path, nm):
    path = tmp_path / "noise_matched.csv"
    nm.write_row(path, _row("higradavg-exact", 0.8, "validation", 0, 0.40))
    nm.write_row(path, _row("higradavg-exact", 1.6, "validation", 0, 0.45))
    nm.write_row(path, _row("higradavg-exact", 0.8, "validation", 0, 0.41))  # rerun: replaced
    rows = list(csv.DictReader(path.open()))
    assert [(r["learning_rate"], r["acc_final"]) for r in rows] == [("1.6", "0.45"), ("0.8", "0.41")]


def test_summary_compares_the_finalists_over_the_seeds_they_all_ran(tmp_path, nm):
    _write(tmp_path / "method_learning_rate_choice.csv", [
        {"run": "higradavg-exact", "alpha": 1.0, "learning_rate": 0.2},
        {"run": "local-item-dp", "alpha": 1.0, "learning_rate": 3.2}])
    base = {"method": "", "accounting": "", "inclusion": "", "rounds": 100, "unit": "", "epsilon": 4.0,
            "alpha": 1.0, "evaluate_on": "test", "noise_multiplier": 52.5}
    _write(tmp_path / "femnist.csv", [
        {**base, "run": "higradavg-exact", "learning_rate": 0.2, "seed": 0, "acc_final": 0.10},
        {**base, "run": "higradavg-exact", "learning_rate": 0.2, "seed": 1, "acc_final": 0.20},
        {**base, "run": "higradavg-exact", "learning_rate": 0.4, "seed": 0, "acc_final": 0.90}])  # not chosen
    h = "higradavg-exact"
    # 1.6 wins seed 0 alone, but 0.8 has the higher mean over seeds 0 and 1 (both rates ran)
    _write(tmp_path / "noise_matched.csv", [
        _row(h, 0.8, "validation", 0, 0.40), _row(h, 1.6, "validation", 0, 0.45),
        _row(h, 3.2, "validation", 0, 0.30),
        _row(h, 0.8, "validation", 1, 0.50), _row(h, 1.6, "validation", 1, 0.40),
        _row(h, 0.8, "test", 0, 0.42), _row(h, 0.8, "test", 1, 0.46), _row(h, 1.6, "test", 0, 0.99),
        # the snr cell chooses on its own rows
        _row(h, 1.6, "validation", 0, 0.55, match="snr"), _row(h, 3.2, "validation", 0, 0.50, match="snr"),
        _row(h, 1.6, "test", 0, 0.56, match="snr")])
    rows = {(r["run"], r["writers_matched"], r["match"]): r for r in nm.summary(tmp_path)}
    real, matched = rows[(h, 300, "calibrated")], rows[(h, 3500, "noise")]
    assert rows[(h, 3500, "snr")]["learning_rate"] == 1.6 and rows[(h, 3500, "snr")]["acc_mean"] == 0.56
    assert real["learning_rate"] == 0.2 and real["seeds"] == 2 and abs(real["acc_mean"] - 0.15) < 1e-9
    assert matched["learning_rate"] == 0.8 and matched["seeds"] == 2 and abs(matched["acc_mean"] - 0.44) < 1e-9
    assert matched["validation_seeds"] == 2
    assert nm.plot(tmp_path).is_file()
