"""Budget exhaustion stops cleanly; a restarted server resumes the ledger."""

import json

import pytest

from flwr_jdp.joint_dp.config import parse_config
from flwr_jdp.privacy.ledger import PrivacyLedger, owner_scope
from flwr_jdp.strategies import load_results

from .helpers import Killed, kill_after_trains, run_inprocess


def test_budget_exhausted_stops_cleanly_with_model_and_ledger(run_config):
    run_config.update({"num-rounds": 10, "noise-multiplier": 0.8, "target-epsilon": 6.0})
    run_inprocess(run_config)
    res = load_results(run_config["results-dir"])
    assert res["status"] == "budget-exhausted"
    assert 1 <= res["rounds_completed"] < 10
    assert res["epsilon"] <= 6.0
    ledger = PrivacyLedger.load(f"{run_config['results-dir']}/ledger.json")
    assert ledger.epsilon() == pytest.approx(res["epsilon"])


def test_calibrated_run_meets_target(run_config):
    run_config.update({"noise-multiplier": 0.0, "target-epsilon": 3.0, "num-rounds": 2})
    strategy, _, _ = run_inprocess(run_config)
    res = load_results(run_config["results-dir"])
    assert res["status"] == "completed"
    assert 0.95 * 3.0 <= res["epsilon"] <= 3.0
    assert strategy.noise_multiplier > 0


def test_restart_keeps_the_charge_of_the_interrupted_round(run_config, tmp_path):
    """Charge, save, release: the server is killed in round 3 after one node has
    trained (its owners released), before the round ends. The ledger on disk already
    charges round 3; the resumed run keeps that charge and charges the re-run of
    round 3 again, so every release any owner made is charged: the server's ledger
    equals an uninterrupted 4-round run's, and for every owner it charges at least
    the releases the owner recorded in its own ledger."""
    ref = dict(run_config, **{"results-dir": str(tmp_path / "ref"), "num-rounds": 4})
    run_inprocess(ref)
    eps_four_rounds = load_results(ref["results-dir"])["epsilon"]

    cfg = dict(run_config, **{"num-rounds": 3})
    nodes = {"state-dir": str(tmp_path / "node-state")}
    with pytest.raises(Killed):
        run_inprocess(cfg, fault=kill_after_trains(4), node_config=nodes)
    mid = load_results(cfg["results-dir"])
    assert mid["status"] == "running" and mid["rounds_completed"] == 2
    on_disk = PrivacyLedger.load(f"{cfg['results-dir']}/ledger.json")
    assert [r["round"] for r in on_disk.rounds] == [1, 2, 3]  # charged before the crash
    assert mid["rounds_charged"] == 3
    session = mid["session"]
    released = {o: len(_owner_ledger(tmp_path, session, o)["rounds"]) for o in range(4)}
    assert sorted(released.values()) == [2, 2, 3, 3]  # node 0's owners released round 3

    run_inprocess(cfg, node_config=nodes)
    res = load_results(cfg["results-dir"])
    assert res["status"] == "completed" and [r["round"] for r in res["history"]] == [1, 2, 3]
    ledger = PrivacyLedger.load(f"{cfg['results-dir']}/ledger.json")
    assert [r["round"] for r in ledger.rounds] == [1, 2, 3, 3]
    assert res["epsilon"] == pytest.approx(eps_four_rounds, rel=1e-9)
    for o in range(4):
        own = _owner_ledger(tmp_path, session, o)
        assert len(own["rounds"]) == released[o] + 1
        assert sum(c for _, c in ledger.scopes[owner_scope(o)]) >= sum(c for _, c in own["scopes"]["self"])
        assert own["epsilon"] <= ledger.scope_epsilon(owner_scope(o)) * (1 + 1e-9)


def _owner_ledger(tmp_path, session, owner):
    """The owner's own ledger on its node's disk (the same file whatever the session)."""
    assert (tmp_path / "node-state" / session).is_dir()
    return json.loads((tmp_path / "node-state" / "owners" / f"ledger-{owner}.json").read_text())


def test_restart_reuses_personal_state_kept_on_the_nodes_disk(run_config, tmp_path):
    """A restarted run loses every context.state (new Flower run); nodes with a
    state-dir reload their owners' personal layers, a fresh session does not."""
    cfg = dict(run_config, **{"num-rounds": 3})
    nodes = {"state-dir": str(tmp_path / "node-state")}
    with pytest.raises(Killed):
        run_inprocess(cfg, fault=kill_after_trains(4), node_config=nodes)
    session = load_results(cfg["results-dir"])["session"]
    assert sorted(p.name for p in (tmp_path / "node-state" / session).glob("personal-*")) == [
        f"personal-{o}.npz" for o in range(4)]
    _, grid, _ = run_inprocess(cfg, node_config=nodes)  # fresh contexts, same disk
    res = load_results(cfg["results-dir"])
    assert res["session"] == session
    assert [r["personal_rounds_min"] for r in res["history"]] == [1, 2, 3]  # continued, not reset
    # nothing personal was ever sent
    for reply in grid.sent:
        assert not any(k.startswith("personal") for k in reply.content.keys())
    # a fresh (non-resumed) run gets a new session and fresh personal layers
    fresh = dict(cfg, **{"resume": False})
    run_inprocess(fresh, node_config=nodes)
    res2 = load_results(cfg["results-dir"])
    assert res2["session"] != session
    assert [r["personal_rounds_min"] for r in res2["history"]] == [1, 2, 3]


def test_config_change_starts_fresh(run_config):
    run_inprocess(run_config)
    changed = dict(run_config, **{"clipping-norm": 2.0})
    assert parse_config(changed).clipping_norm == 2.0
    run_inprocess(changed)
    assert load_results(run_config["results-dir"])["config"]["clipping-norm"] == 2.0
