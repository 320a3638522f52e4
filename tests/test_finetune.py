"""Adaptation of each owner's final model to its own data (joint DP, run-config
``finetune-epochs``): the model evaluated after the last round changes, nothing
sent or stored does, and the ledger is that of a run without it."""

import numpy as np
import pytest
import torch
from flwr_jdp.strategies import load_results

from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import ConfigError, parse_config
from flwr_jdp.joint_dp.owner_round import adapted_model
from flwr_jdp.joint_dp.owner_state import new_model, owner_data
from flwr_jdp.params import get_arrays
from flwr_jdp.training import evaluate
from research.reproduce_joint_dp import comparable

from .helpers import run_inprocess


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


def test_adapted_model_trains_every_parameter_of_a_copy():
    cfg = parse_config({"method": "joint-dp", "finetune-epochs": 3, "finetune-learning-rate": 0.2,
                        "num-owners": 2, "batch-size": 16})
    data = owner_data(cfg)[0]
    model, split = new_model(cfg, data)
    names = split.shared + split.personal
    assert split.shared and split.personal
    before = get_arrays(model, names)
    out = adapted_model(model, data, cfg, torch.Generator().manual_seed(0))
    after = get_arrays(model, names)
    for k, v in before.items():  # the owner's own model is untouched
        np.testing.assert_array_equal(after[k], v)
    adapted = get_arrays(out, names)
    for k, v in before.items():  # every parameter of the copy moved (shared and personal)
        assert not np.allclose(adapted[k], v), k
    # and it fits the owner's training records better than the model it started from
    assert evaluate(out, data.x_train, data.y_train)[0] < evaluate(model, data.x_train, data.y_train)[0]
    none = adapted_model(model, data, parse_config({"method": "joint-dp"}), torch.Generator())
    for k, v in get_arrays(none, names).items():
        np.testing.assert_array_equal(v, before[k])


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
