"""The winsorized user-level mean Flower App (apps/winsorized): its ServerApp
and ClientApp run in-process on synthetic users, within the calibrated budget;
several users per SuperNode travel in one message each way; a bad run config fails
at start-up, naming the key, before anything is sent."""

import json

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from apps.winsorized.winsorized import server_app as wserver
from apps.winsorized.winsorized import task as wtask
from apps.winsorized.winsorized.client_app import client
from apps.winsorized.winsorized.server_app import main, run_server
from apps.winsorized.winsorized.task import parse_config
from flwr_jdp.config_check import ConfigError
from flwr_jdp.inprocess import InProcessGrid


def _config(tmp_path, **extra):
    return {"num-users": 200, "rounds": 2, "target-epsilon": 4.0, "noise-seed": 3,
            "results-dir": str(tmp_path / "run"), **extra}


def _context(rc):
    return Context(run_id=7, node_id=0, node_config={}, state=RecordDict(), run_config=rc)


def test_app_trains_within_its_budget_one_message_per_supernode(tmp_path):
    rc = _config(tmp_path)
    grid = InProcessGrid(client, 4, rc)
    strategy, result = run_server(grid, _context(rc))
    assert strategy.status == "completed" and [h["round"] for h in strategy.history] == [1, 2]
    assert not any(h["skipped"] for h in strategy.history)
    # user level, calibrated to the target over the run's rounds, charged round by round
    assert 0.95 * 4.0 < strategy.ledger.epsilon() <= 4.0
    saved = json.loads((tmp_path / "run" / "ledger.json").read_text())
    assert saved["unit"] == "user" and [r["round"] for r in saved["rounds"]] == [1, 2]
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["status"] == "completed" and res["epsilon"] <= 4.0 and res["num_users"] == 200
    # accuracy: mean over users of the global model on their test records, above chance (1/4)
    acc = result.evaluate_metrics_clientapp[2]["accuracy"]
    assert np.isfinite(acc) and acc > 0.35
    source, _ = parse_config(rc)
    w, model = result.arrays["w"].numpy(), source.model()
    users = source.users(tuple(range(200)))
    assert acc == pytest.approx(np.mean([model.accuracy(w, u.x_test, u.y_test) for u in users]))
    assert np.allclose(np.load(tmp_path / "run" / "model.npy"), w)
    # 200 users on 4 SuperNodes: one set-up, train and evaluate message per node and round
    kinds = [m.metadata.message_type for m in grid.sent]
    assert kinds.count(MessageType.QUERY) == 4
    assert kinds.count(MessageType.TRAIN) == kinds.count(MessageType.EVALUATE) == 4 * 2
    train = next(m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN)
    assert set(train.content.keys()) == {"arrays", "metrics"} and len(train.content["arrays"]) == 50


def test_one_user_per_supernode_and_plain_flower_requests(tmp_path):
    rc = _config(tmp_path, **{"num-users": 3, "rounds": 1, "target-epsilon": 8.0})
    grid = InProcessGrid(client, 3, rc)
    strategy, _ = run_server(grid, _context(rc))
    assert strategy.status == "completed" and strategy.history[0]["valid_updates"] == 3
    # a node with one user answers a plain Flower message (no 'users' in config) in Flower's format
    source, cfg = parse_config(rc)
    w0 = np.zeros(source.model().num_params)
    msg = Message(RecordDict({"arrays": ArrayRecord({"w": Array(w0)}), "config": ConfigRecord()}),
                  dst_node_id=1001, message_type=MessageType.TRAIN)
    (reply,) = grid.send_and_receive([msg])
    user = source.users((1,))[0]
    assert reply.content["metrics"]["num-examples"] == len(user.y_train)
    expected = wtask.local_update(source.model(), w0, user, cfg.local_steps, cfg.lr)
    assert np.allclose(reply.content["arrays"]["w"].numpy(), expected)


def test_a_user_missing_from_its_supernodes_reply_skips_the_round(tmp_path):
    def lose_user_5(instruction, reply):  # noqa: ANN001, ANN202
        if instruction.metadata.message_type == MessageType.TRAIN and "user.5" in reply.content["arrays"]:
            arrays = {k: v for k, v in reply.content["arrays"].items() if k != "user.5"}
            return Message(RecordDict({"arrays": ArrayRecord(arrays), "metrics": reply.content["metrics"]}),
                           reply_to=instruction)
        return reply

    rc = _config(tmp_path, **{"num-users": 8, "rounds": 1, "target-epsilon": 8.0})
    strategy, _ = run_server(InProcessGrid(client, 2, rc, fault=lose_user_5), _context(rc))
    assert strategy.history[0]["skipped"] and strategy.history[0]["valid_updates"] == 7
    assert any("no reply for user 5" in d for d in strategy.dropped)


def test_users_no_supernode_hosts_fail_before_any_release(tmp_path, monkeypatch):
    monkeypatch.setattr(wserver, "SETUP_TIMEOUT", 0.5)
    rc = _config(tmp_path, **{"num-users": 6})

    def silent_node(instruction, reply):  # noqa: ANN001, ANN202
        return None if instruction.metadata.dst_node_id == 1001 else reply

    grid = InProcessGrid(client, 2, rc, fault=silent_node)
    with pytest.raises(RuntimeError, match="3 of num-users=6 users are hosted by no responding SuperNode"):
        main(grid, _context(rc))
    assert not (tmp_path / "run" / "ledger.json").exists()
    assert {m.metadata.message_type for m in grid.sent} == {MessageType.QUERY}


@pytest.mark.parametrize(("key", "value"), [
    ("num-users", 1), ("rounds", 0), ("local-steps", 0), ("lr", "fast"), ("target-epsilon", 0.0),
    ("delta", 1.0), ("bound", -1.0), ("tau", 0.0), ("range-share", 1.0), ("dataset", "cifar"),
    ("classes", 1), ("pool", 0), ("noise-seed", -2),
])
def test_a_bad_run_config_value_fails_at_start_up_naming_the_key(tmp_path, key, value):
    rc = _config(tmp_path, **{key: value})
    grid = InProcessGrid(client, 2, rc)
    with pytest.raises(ConfigError, match=f"run-config key '{key}'"):
        main(grid, _context(rc))
    assert not grid.sent and not (tmp_path / "run").exists()


def test_secure_noise_cannot_be_seeded(tmp_path):
    with pytest.raises(ConfigError, match="noise-seed"):
        parse_config(_config(tmp_path, **{"secure-noise": True}))


def test_a_results_dir_holding_a_ledger_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ledger.json").write_text("{}")
    rc = _config(tmp_path)
    grid = InProcessGrid(client, 2, rc)
    with pytest.raises(ConfigError, match="results-dir"):
        main(grid, _context(rc))
    assert not grid.sent
