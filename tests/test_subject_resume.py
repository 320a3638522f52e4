"""A restarted subject-level run continues from its checkpoint: model, ledger
(epsilon not reset), history; a round charged before a crash is never un-charged."""

from __future__ import annotations

import json

import pytest
from flwr.app import MessageType

from flwr_jdp.subject.config import parse_subject_config


class CrashAfterSave(Exception):
    """Stands in for the ServerApp being killed."""


def _apps():
    from apps.subject_dp.subject_dp.client_app import client
    from apps.subject_dp.subject_dp.server_app import test_evaluator
    from flwr_jdp.inprocess import InProcessGrid
    from flwr_jdp.strategies.subject_level import SubjectLevelFedAvg
    from flwr_jdp.subject.task import build_subject_model
    return client, test_evaluator, SubjectLevelFedAvg, InProcessGrid, build_subject_model


def _config(tmp_path, femnist_dir, **extra) -> dict:
    return {"data-dir": str(femnist_dir), "max-writers": 20, "num-silos": 4, "budget-rounds": 3,
            "method": "higradavg-dp", "accounting": "exact", "noise-seed": 0, "eval-every": 1,
            "results-dir": str(tmp_path / "run"), "batch-size": 32, **extra}


def _strategy(rc, crash_after_round: int | None = None):
    client, test_evaluator, strategy_cls, _, build_model = _apps()
    cfg = parse_subject_config(rc)

    class Crashing(strategy_cls):
        def _save(self, ledger, status):  # noqa: ANN001, ANN202
            super()._save(ledger, status)
            if crash_after_round is not None and len(self.history) == crash_after_round:
                raise CrashAfterSave

    return Crashing(cfg, build_model(cfg), test_evaluator(cfg), rc)


def test_restart_between_rounds_continues_with_the_spent_epsilon(tmp_path, femnist_dir) -> None:
    _, _, _, grid_cls, _ = _apps()
    ref_strategy = _strategy(_config(tmp_path / "ref", femnist_dir))
    ref_strategy.start(grid_cls(_apps()[0], 2, _config(tmp_path / "ref", femnist_dir)))
    reference = ref_strategy.results()
    rc = _config(tmp_path, femnist_dir)
    with pytest.raises(CrashAfterSave):
        _strategy(rc, crash_after_round=2).start(grid_cls(_apps()[0], 2, rc))
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["status"] == "running" and len(saved["history"]) == 2
    spent = saved["epsilon"]
    restarted = _strategy(rc)
    restarted.start(grid_cls(_apps()[0], 2, rc))
    out = restarted.results()
    assert out["status"] == "completed"
    assert [h["round"] for h in restarted.history] == [1, 2, 3]
    assert restarted.history[1]["epsilon"] == pytest.approx(spent)
    # three rounds charged in all: the same epsilon as the run that never crashed
    assert out["ledger_epsilon"] == pytest.approx(reference["ledger_epsilon"], rel=1e-9)
    assert len(out["batch_stats"]["group_sizes"]) == len(reference["batch_stats"]["group_sizes"])


def _crash_on_train_call(grid, n: int):
    calls = {"train": 0}
    original = grid.send_and_receive

    def send_and_receive(messages, *args, **kwargs):  # noqa: ANN001, ANN202
        messages = list(messages)
        if messages and messages[0].metadata.message_type == MessageType.TRAIN:
            calls["train"] += 1
            if calls["train"] == n:
                raise CrashAfterSave
        return original(messages, *args, **kwargs)
    grid.send_and_receive = send_and_receive
    return grid


def test_round_charged_before_a_crash_is_charged_again_when_rerun(tmp_path, femnist_dir) -> None:
    """Fixed noise, generous budget: the interrupted round 3 keeps its charge and
    its re-run is charged too (4 rounds on the ledger, 3 in the history)."""
    _, _, _, grid_cls, _ = _apps()
    rc = _config(tmp_path, femnist_dir, **{"noise-multiplier": 5.0, "target-epsilon": 1000.0})
    with pytest.raises(CrashAfterSave):
        _strategy(rc).start(_crash_on_train_call(grid_cls(_apps()[0], 2, rc), 3))
    ledger = json.loads((tmp_path / "run" / "ledger.json").read_text())
    assert [r["round"] for r in ledger["rounds"]] == [1, 2, 3]
    restarted = _strategy(rc)
    restarted.start(grid_cls(_apps()[0], 2, rc))
    out = restarted.results()
    assert out["status"] == "completed"
    ledger = json.loads((tmp_path / "run" / "ledger.json").read_text())
    assert [r["round"] for r in ledger["rounds"]] == [1, 2, 3, 3]
    assert out["ledger_epsilon"] > out["plan"]["epsilon"]


def test_rerun_that_would_exceed_the_target_stops_with_model_and_ledger_saved(tmp_path, femnist_dir) -> None:
    """Noise calibrated to the target over 3 rounds: after a crash in round 3 a
    re-run would overspend, so the run stops (budget-exhausted), ledger within target."""
    _, _, _, grid_cls, _ = _apps()
    rc = _config(tmp_path, femnist_dir)
    with pytest.raises(CrashAfterSave):
        _strategy(rc).start(_crash_on_train_call(grid_cls(_apps()[0], 2, rc), 3))
    rerun = _strategy(rc)
    rerun.start(grid_cls(_apps()[0], 2, rc))
    out = rerun.results()
    assert out["status"] == "budget-exhausted"
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["status"] == "budget-exhausted" and saved["epsilon"] <= 4.0 * (1 + 1e-6)
    assert (tmp_path / "run" / "model.npz").is_file()


def test_crash_in_round_one_keeps_its_charge(tmp_path, femnist_dir) -> None:
    """A crash during round 1 (after its charge, before any round completed) is
    resumed: round 1's charge stays and its re-run is charged too."""
    _, _, _, grid_cls, _ = _apps()
    rc = _config(tmp_path, femnist_dir, **{"noise-multiplier": 5.0, "target-epsilon": 1000.0})
    with pytest.raises(CrashAfterSave):
        _strategy(rc).start(_crash_on_train_call(grid_cls(_apps()[0], 2, rc), 1))
    rerun = _strategy(rc)
    rerun.start(grid_cls(_apps()[0], 2, rc))
    out = rerun.results()
    assert out["status"] == "completed"
    ledger = json.loads((tmp_path / "run" / "ledger.json").read_text())
    assert [r["round"] for r in ledger["rounds"]] == [1, 1, 2, 3]
