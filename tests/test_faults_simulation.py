"""Faults in Flower's Ray simulation: a ClientApp that raises and one that hangs past
the round timeout. The round completes with the other owners, is charged in full
(accounting happens before the release, whoever answers), and nothing crashes."""

import json
import time

import pytest
from flwr.app import ConfigRecord

from research.simulation import simulate

pytestmark = pytest.mark.extended  # long end-to-end check: `pytest -m extended` (not in CI)


def _faulty(kind_wanted, behaviour):
    """Node with partition-id 1 misbehaves once, in its first `kind_wanted` call."""

    def wrap(kind, handler):
        if kind != kind_wanted:
            return handler

        def inner(msg, context):
            flag = "fault.done"
            if int(context.node_config["partition-id"]) == 1 and flag not in context.state:
                context.state[flag] = ConfigRecord({"done": True})
                if behaviour == "raise":
                    raise RuntimeError("injected ClientApp crash")
                time.sleep(25)  # hang past the round timeout
            return handler(msg, context)
        return inner

    return wrap


@pytest.mark.parametrize("behaviour", ["raise", "hang"])
def test_round_completes_without_the_faulty_node_and_is_charged(tmp_path, behaviour):
    results = tmp_path / "results"
    cfg = {"num-owners": 4, "num-rounds": 2, "local-epochs": 1, "batch-size": 32,
           "noise-multiplier": 1.0, "target-epsilon": 50.0, "noise-seed": 5,
           "results-dir": str(results), "resume": False, "round-timeout": 10.0}
    simulate("joint-dp", cfg, num_supernodes=2, wrap=_faulty("train", behaviour))
    res = json.loads((results / "results.json").read_text())
    assert res["status"] == "completed"
    first, second = res["history"]
    assert first["dropped_owners"] == 2 and first["valid_owners"] == 2  # node 1 hosts owners 1, 3
    assert not first["skipped"]
    assert 0 < first["epsilon"] < second["epsilon"]  # both rounds charged in full
    ledger = json.loads((results / "ledger.json").read_text())
    assert [r["round"] for r in ledger["rounds"]] == [1, 2]
    assert ledger["rounds"][0]["scopes"] == 4  # owners 1 and 3 charged although dropped
