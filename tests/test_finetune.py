"""Adaptation of each owner's final model to its own data (joint DP, run-config
``finetune-epochs``, done by the own app's evaluate handler on a copy): the model
evaluated after the last round changes, nothing sent or stored does, and the ledger
is that of a run without it."""

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from apps.joint_dp.joint_dp import client_app
from apps.joint_dp.joint_dp.task import initial_model, owner_data
from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import ConfigError, parse_config
from flwr_jdp.joint_dp.owner_store import (
    load_personal_arrays,
    personal_fit_on,
    save_personal_arrays,
    shared_digest,
    trained_rounds,
)
from flwr_jdp.strategies import load_results
from flwr_jdp.training import evaluate
from research.reproduce_joint_dp import comparable

from .helpers import own_app_owner, run_inprocess


@pytest.mark.parametrize("key,value,allowed", [
    ("finetune-epochs", -1, ">= 0 epochs"),
    ("finetune-learning-rate", 0.0, "> 0 and finite"),
    ("finetune-learning-rate", float("nan"), "> 0 and finite"),
])
def test_bad_values_fail_at_start_up_naming_the_key(key, value, allowed):
    with pytest.raises(ConfigError, match=f"'{key}' must be {allowed}"):
        parse_config({"method": "joint-dp", key: value})


@pytest.mark.parametrize("method", ["full-dp", "fedavg", "per-silo"])
def test_only_joint_dp_may_adapt(method):
    """Full DP promises that every owner's model is DP; adapting it on the owner's
    data without noise would break that promise, so the key is refused."""
    with pytest.raises(ConfigError, match="'finetune-epochs' must be 0 unless method = 'joint-dp'"):
        parse_config({"method": method, "finetune-epochs": 2})
    parse_config({"method": "joint-dp", "finetune-epochs": 2})


def test_runs_stored_before_the_keys_existed_compare_equal():
    old = {"seed": 0, "finetune-epochs": 0, "finetune-learning-rate": 0.05}
    assert comparable(old) == {"seed": 0}
    assert comparable({"seed": 0, "finetune-epochs": 3}) == {"seed": 0, "finetune-epochs": 3}


def _evaluate(monkeypatch, rc, server_round, owner=0):
    """The own app's evaluate handler for ``owner`` at ``server_round``, its personal
    state (not the public values) already fitted on the broadcast. Returns the
    reply, the model the handler tested (a copy), the owner's own model (broadcast
    plus personal state), the owner's state before and after, and its data."""
    ctx, cfg, rec, split = own_app_owner(rc, owner, 2)
    shared = {n: rec[n].numpy() for n in split.shared}
    personal = {n: rec[n].numpy() + np.float32(0.01) for n in split.personal}
    save_personal_arrays(ctx, owner, personal, "s1", fit_on=shared_digest(shared))  # one trained round
    tested = []

    def spy(model, x, y):  # the app's own test function, watched
        tested.append({n: p.detach().numpy().copy() for n, p in model.named_parameters()})
        return real_test(model, x, y)

    real_test = client_app.test
    monkeypatch.setattr(client_app, "test", spy)
    InProcessGrid(client_app.app, 1, ctx.run_config)  # stamps message identities
    msg = Message(RecordDict({protocol.SHARED: protocol.to_record(shared), protocol.CONFIG: ConfigRecord(
        {protocol.ROUND: server_round, protocol.SESSION: "s1"})}), dst_node_id=ctx.node_id,
        message_type=MessageType.EVALUATE)
    reply = client_app.app(msg, ctx)
    assert reply.has_content(), reply.error.reason
    assert len(tested) == 1
    state = (load_personal_arrays(ctx, owner, "s1"), trained_rounds(ctx, owner, "s1"),
             personal_fit_on(ctx, owner, "s1"))
    return reply, tested[0], {**shared, **personal}, state, owner_data(cfg)[owner]


def test_the_evaluated_model_after_the_last_round_is_an_adapted_copy(monkeypatch):
    """Every parameter of the copy (shared and personal) moves, and it fits the
    owner's training records better than the owner's model; the owner's stored
    state is untouched and the reply carries metrics only. Before the last round,
    or without the key, the owner's own model is evaluated."""
    rc = {"method": "joint-dp", "num-owners": 2, "num-rounds": 3, "batch-size": 16,
          "finetune-epochs": 3, "finetune-learning-rate": 0.05, "noise-seed": 3}  # seeded: reproducible batches
    reply, tested, own, (personal, rounds, fit_on), data = _evaluate(monkeypatch, rc, server_round=3)
    assert set(reply.content.keys()) == {protocol.METRICS}
    assert set(tested) == set(own)
    for k, v in own.items():
        assert not np.allclose(tested[k], v), k
    for k, v in personal.items():  # the stored personal state is the owner's, not the adapted copy's
        np.testing.assert_array_equal(v, own[k])
    assert rounds == 1 and fit_on == shared_digest({k: v for k, v in own.items() if k not in personal})

    def train_loss(arrays):
        model = initial_model(parse_config(rc))
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(torch.from_numpy(arrays[n]))
        return evaluate(model, data.x_train, data.y_train)[0]

    assert train_loss(tested) < train_loss(own)
    adapted_loss = float(reply.content[protocol.METRICS][protocol.LOSS])
    for over, server_round in (({}, 2), ({"finetune-epochs": 0}, 3)):
        reply, tested, own, (personal, *_), _ = _evaluate(monkeypatch, dict(rc, **over), server_round)
        for k, v in own.items():
            np.testing.assert_array_equal(tested[k], v)
        for k, v in personal.items():
            np.testing.assert_array_equal(v, own[k])
        assert float(reply.content[protocol.METRICS][protocol.LOSS]) != adapted_loss


@pytest.mark.parametrize("placement", ["local", "central"])
def test_adaptation_changes_the_evaluated_accuracy_but_no_message_or_state(run_config, tmp_path, placement):
    """Two seeded runs, one adapting the final models: every train reply is
    bit-identical, the personal state kept in context.state is identical, the
    ledger is identical, and only the last round's evaluation metrics differ."""
    run_config.update({"method": "joint-dp", "num-rounds": 3, "noise-placement": placement})

    def record(store):
        def capture(instruction, reply):
            kind = instruction.metadata.message_type
            if kind == "train":
                store["train"].append({(r, k): v.numpy().copy() for r, rec in reply.content.items()
                                       if hasattr(rec, "to_numpy_ndarrays") for k, v in rec.items()})
            elif kind == "evaluate":
                store["evaluate"].append({r: float(rec[protocol.ACCURACY])
                                          for r, rec in reply.content.items() if protocol.ACCURACY in rec})
            return reply
        return capture

    plain, adapted = {"train": [], "evaluate": []}, {"train": [], "evaluate": []}
    _, grid_plain, _ = run_inprocess(run_config, fault=record(plain))
    ft = dict(run_config, **{"finetune-epochs": 2, "finetune-learning-rate": 0.1,
                             "results-dir": str(tmp_path / "adapted")})
    _, grid_ft, _ = run_inprocess(ft, fault=record(adapted))

    assert plain["train"] and len(plain["train"]) == len(adapted["train"])
    for a, b in zip(plain["train"], adapted["train"], strict=True):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    for node, ctx in grid_plain.contexts.items():
        other = grid_ft.contexts[node]
        for key in ctx.state.keys():
            if key.startswith("personal.") and not key.endswith(".meta"):
                for x, y in zip(ctx.state[key].to_numpy_ndarrays(), other.state[key].to_numpy_ndarrays(),
                                strict=True):
                    np.testing.assert_array_equal(x, y)
    res_plain, res_ft = load_results(run_config["results-dir"]), load_results(ft["results-dir"])
    assert res_ft["status"] == "completed"
    assert res_ft["epsilon"] == res_plain["epsilon"] > 0
    assert [r["epsilon"] for r in res_ft["history"]] == [r["epsilon"] for r in res_plain["history"]]
    assert len(plain["evaluate"]) == len(adapted["evaluate"]) == 2 * 3  # 2 nodes, 3 rounds
    # rounds 1 and 2 evaluate the same (unadapted) models; the last round the adapted ones
    assert plain["evaluate"][:4] == adapted["evaluate"][:4]
    last_plain = [v for e in plain["evaluate"][4:] for v in e.values()]
    last_ft = [v for e in adapted["evaluate"][4:] for v in e.values()]
    assert len(last_plain) == 4 and last_plain != last_ft
    assert res_ft["final_accuracy"] != res_plain["final_accuracy"]
