"""No personal parameter ever leaves its ClientApp, by name or by value."""

import numpy as np
import pytest

from apps.joint_dp.joint_dp.server_app import initial_arrays
from flwr_jdp.joint_dp.owner_store import personal_key
from flwr_jdp.strategies import load_results

CASES = [(u, p) for u in ("record", "user", "owner") for p in ("local", "central")]


def all_arrays(message):
    """Every array in every record of a message, with its record and key."""
    out = []
    for rec_name, record in message.content.items():
        if hasattr(record, "to_numpy_ndarrays"):
            for key in record.keys():
                out.append((rec_name, key, record[key].numpy()))
    return out


@pytest.mark.parametrize("unit,placement", CASES)
def test_no_personal_parameter_in_any_message(run_config, unit, placement):
    run_config.update({"privacy-unit": unit, "noise-placement": placement, "records-per-user": 3,
                       "num-rounds": 3})
    snapshots = []  # personal arrays of every owner, after every reply

    def snapshot(instruction, reply):
        for ctx in grid_ref[0].contexts.values():
            for key in list(ctx.state.keys()):
                if key.startswith("personal.") and not key.endswith(".meta"):
                    snapshots.append((key, [a.copy() for a in ctx.state[key].to_numpy_ndarrays()]))
        return reply

    grid_ref = []
    from apps.joint_dp.joint_dp.client_app import app
    from flwr_jdp.inprocess import InProcessGrid
    from flwr_jdp.joint_dp.config import parse_config
    from flwr_jdp.strategies import JointDP

    grid = InProcessGrid(app, 2, run_config, fault=snapshot)
    grid_ref.append(grid)
    cfg = parse_config(run_config)
    JointDP(cfg).start(grid=grid, initial_arrays=initial_arrays(cfg))

    assert grid.sent, "the ClientApp sent nothing"
    personal_names = {"fc1.weight", "fc1.bias"}
    sent_arrays = [a for m in grid.sent for a in all_arrays(m)]
    assert sent_arrays, "no arrays were sent"
    for rec_name, key, _ in sent_arrays:
        assert key not in personal_names, f"personal parameter {key} sent in {rec_name}"
    personal_values = [v for _, arrays in snapshots for v in arrays]
    assert personal_values
    for _, key, value in sent_arrays:
        for pv in personal_values:
            if pv.shape == value.shape:
                assert not np.allclose(pv, value), f"array {key} equals a personal array"
    # personal state persists and changes across rounds
    states = {}
    for key, arrays in snapshots:
        states.setdefault(key, []).append(arrays[0])
    assert set(states) == {personal_key(o) for o in range(4)}
    for key, seq in states.items():
        assert any(not np.array_equal(seq[0], later) for later in seq[1:]), f"{key} never trained"
    res = load_results(run_config["results-dir"])
    assert res["status"] == "completed"
    assert [r["epsilon"] for r in res["history"]] == sorted(r["epsilon"] for r in res["history"])
    assert res["history"][-1]["epsilon"] > 0
