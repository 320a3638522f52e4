"""Subject-level silos enforce their own side of the guarantee (public cap): each silo
recomputes the plan from its run config, and a malicious server that sends no noise
(z = 0), samples every record (q = 1), repeats a round or asks for a round past the
plan gets refusals (error replies naming the reason) with nothing trained, charged
or sent. The honest plan is accepted and charged once per round; the ledger on the
node's state-dir survives a restart; noise is fresh per release. Also: a plan over
``target-epsilon`` is refused by the server at start-up and by every silo, and the
public cap refuses ``report-batch-stats``. No data set is needed: the silos' data and
model are small stand-ins."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from torch import nn

from apps.subject_dp.subject_dp import client_app as subject_app
from flwr_jdp.config_check import ConfigError
from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import owner_guard
from flwr_jdp.privacy import guard
from flwr_jdp.records import hosted_owners
from flwr_jdp.strategies.subject_level import SubjectLevelFedAvg
from flwr_jdp.subject import silo_data as sd
from flwr_jdp.subject.config import parse_subject_config
from flwr_jdp.subject.plan import make_plan
from flwr_jdp.subject.protocol import CONFIG, MODEL, SILOS, model_arrays, silo_key
from flwr_jdp.subject.silo_guard import SiloAgreement, cap_agreement
from flwr_jdp.training.subject_level import SiloData

RC = {"num-silos": 4, "budget-rounds": 2, "local-steps": 1, "batch-size": 8, "sample-rate": 0.1,
      "max-records-per-subject": 4, "target-epsilon": 4.0, "data-dir": "/nonexistent", "results-dir": ""}
LEDGER_DIR = "silos"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 3)


@pytest.fixture
def silos(monkeypatch):
    """Stand-in data and model for every silo; records which silos' data were read
    and how often a silo trained."""
    seen = {"data": [], "trained": 0}

    def silo_data(cfg, index):  # noqa: ANN001, ANN202
        seen["data"].append(int(index))
        rng = np.random.default_rng(index)
        n = 40
        return SiloData.from_numpy(rng.normal(size=(n, 4)), rng.integers(0, 3, n), np.arange(n) % 10)

    real_train = subject_app.train_silo_round

    def train_silo_round(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen["trained"] += 1
        return real_train(*args, **kwargs)

    monkeypatch.setattr(sd, "silo_data", silo_data)
    monkeypatch.setattr(subject_app, "build_subject_model", lambda cfg: _model())
    monkeypatch.setattr(subject_app, "train_silo_round", train_silo_round)
    return seen


def _plan(rc=RC):
    return make_plan(parse_subject_config(rc))


def _grid(tmp_path, rc=RC):
    return InProcessGrid(subject_app.client, 2, rc, node_config={"state-dir": str(tmp_path)})


def _honest(rnd: int, rc=RC) -> dict:
    plan = _plan(rc)
    return {"round": rnd, "noise-multiplier": float(plan.noise_multiplier),
            "calibration-steps": int(plan.calibration_steps), "q": float(plan.sample_rates[0])}


def _send(grid, rnd, **over) -> list[Message]:
    """One train message per node, for the silos it hosts (with 4 silos: 0, 2 on node 0; 1, 3 on node 1)."""
    spec = dict(_honest(rnd), **over)
    q = spec.pop("q")
    drop = spec.pop("drop", None)
    messages = []
    num_silos = int(next(iter(grid.contexts.values())).run_config["num-silos"])
    for p, node in enumerate(grid.get_node_ids()):
        hosted = hosted_owners(num_silos, p, len(grid.contexts))
        conf = {"round": spec["round"], SILOS: hosted, "sample-rates": [q] * len(hosted),
                "noise-multiplier": spec["noise-multiplier"], "calibration-steps": spec["calibration-steps"]}
        conf.pop(drop, None)
        content = RecordDict({MODEL: ArrayRecord(_model().state_dict()), CONFIG: ConfigRecord(conf)})
        messages.append(Message(content, dst_node_id=node, message_type=MessageType.TRAIN))
    return list(grid.send_and_receive(messages))


def _ledgers(grid, tmp_path) -> tuple[dict, dict]:
    """Each silo's ledger as its node keeps it: in context.state (without a state-dir) and on disk."""
    in_state = {}
    for ctx in grid.contexts.values():
        for key in ctx.state.keys():
            if key.startswith("silo-ledger."):
                in_state[int(key.split(".")[1])] = json.loads(str(ctx.state[key]["state"]))
    on_disk = {int(p.stem.split("-")[1]): json.loads(p.read_text())
               for p in sorted((tmp_path / LEDGER_DIR).glob("ledger-*.json"))}
    return in_state, on_disk


def _refused(replies, reason: str) -> None:
    assert len(replies) == 2
    for reply in replies:
        assert reply.has_error() and not reply.has_content()  # fail closed: no model leaves a silo
        assert reply.error.reason.startswith("refused: ") and reason in reply.error.reason, reply.error.reason


# ---------------------------------------------------------------- a malicious server


@pytest.mark.parametrize("over, reason", [
    ({"noise-multiplier": 0.0}, "noise multiplier 0.0 is not a positive number"),
    ({"q": 1.0}, "sampling rate 1.0 is above the agreed 0.1 (from sample-rate)"),
    ({"noise-multiplier": 0.0, "q": 1.0}, "noise multiplier 0.0 is not a positive number"),
    ({"noise-multiplier": "half"}, "is below the agreed noise multiplier calibrated to target-epsilon"),
    ({"round": 3}, "round 3 is outside the agreed 1..2 (budget-rounds)"),
    ({"round": 0}, "round 0 is outside the agreed 1..2"),
    ({"calibration-steps": 1}, "calibration-steps 1, agreed 2"),
    ({"drop": "noise-multiplier"}, "the train instruction lacks ['noise-multiplier']"),
    ({"drop": "calibration-steps"}, "the train instruction lacks ['calibration-steps']"),
])
def test_silos_refuse_an_instruction_outside_their_plan_before_touching_data(silos, tmp_path, over, reason):
    if over.get("noise-multiplier") == "half":
        over = {"noise-multiplier": _honest(1)["noise-multiplier"] / 2}
    grid = _grid(tmp_path)
    _refused(_send(grid, 1, **over), reason)
    assert silos["trained"] == 0 and silos["data"] == []  # nothing trained, no record read
    assert _ledgers(grid, tmp_path) == ({}, {})  # nothing charged


def test_a_repeated_round_and_a_round_past_the_plan_are_refused_with_the_ledger_unchanged(silos, tmp_path):
    grid = _grid(tmp_path)
    first = _send(grid, 1)
    assert all(not r.has_error() for r in first) and silos["trained"] == 4
    assert sorted(k for r in first for k in r.content.array_records) == [silo_key(i) for i in range(4)]
    after_one = _ledgers(grid, tmp_path)
    assert after_one[0] == {} and sorted(after_one[1]) == [0, 1, 2, 3]  # with a state-dir the file is the truth
    assert all([r["round"] for r in led["rounds"]] == [1] for led in after_one[1].values())

    _refused(_send(grid, 1), "round 1 was released already")  # the same round again
    assert silos["trained"] == 4 and _ledgers(grid, tmp_path) == after_one

    assert all(not r.has_error() for r in _send(grid, 2))
    after_two = _ledgers(grid, tmp_path)
    _refused(_send(grid, 3), "round 3 is outside the agreed 1..2")  # past the plan
    _refused(_send(grid, 2), "round 2 was released already")
    assert silos["trained"] == 8 and _ledgers(grid, tmp_path) == after_two

    # the node restarts (fresh context.state, same state-dir): the ledger is read back
    restarted = _grid(tmp_path)
    _refused(_send(restarted, 1), "round 1 was released already")
    assert silos["trained"] == 8
    assert _ledgers(grid, tmp_path)[1] == after_two[1]


def test_each_silo_charges_its_share_of_the_plan(silos, tmp_path):
    """Each silo's ledger holds its own events about the worst-case subject (K records
    here), one round at a time; after the plan's rounds it has spent exactly its share,
    which its budget is."""
    grid = _grid(tmp_path)
    for rnd in (1, 2):
        _send(grid, rnd)
    agreed = cap_agreement(parse_subject_config(RC))
    assert isinstance(agreed, SiloAgreement) and agreed.once_per_round and agreed.party == "silo"
    _, on_disk = _ledgers(grid, tmp_path)
    for state in on_disk.values():
        assert state["unit"] == "subject" and [r["round"] for r in state["rounds"]] == [1, 2]
        assert state["epsilon"] == pytest.approx(agreed.budget, rel=1e-9)
        assert state["epsilon"] < _plan().epsilon  # one silo's share of the subject's composition


def test_noise_is_fresh_per_release(silos, tmp_path):
    """The same honest instruction to two fresh silos gives two different models
    (``noise-seed = -1``: the OS CSPRNG), and neither is the broadcast."""
    a = _send(_grid(tmp_path / "a"), 1)[0].content.array_records[silo_key(0)]
    b = _send(_grid(tmp_path / "b"), 1)[0].content.array_records[silo_key(0)]
    broadcast = model_arrays(_model())
    for key in broadcast:
        assert not np.array_equal(a[key].numpy(), b[key].numpy())
        assert not np.array_equal(a[key].numpy(), broadcast[key])


class TamperingServer(SubjectLevelFedAvg):
    """The real strategy, rewriting every train instruction with ``tamper``."""

    def __init__(self, cfg, tamper):  # noqa: ANN001
        super().__init__(cfg, _model())
        self.tamper = tamper

    def _train_messages(self, server_round):  # noqa: ANN001, ANN202
        messages = super()._train_messages(server_round)
        for m in messages:
            self.tamper(server_round, m.content[CONFIG])
        return messages


def test_a_malicious_strategy_gets_no_release_from_any_silo(silos, tmp_path):
    """End to end through the strategy: z = 0 and q = 1 in every round; every silo
    refuses, the server drops every reply with the reason, and nothing is trained."""
    def tamper(_, rec):  # noqa: ANN001, ANN202
        rec["noise-multiplier"] = 0.0
        rec["sample-rates"] = [1.0] * len(rec["sample-rates"])

    grid = _grid(tmp_path)
    strategy = TamperingServer(parse_subject_config(RC), tamper)
    strategy.start(grid)
    train = [r for r in grid.sent if r.metadata.message_type == MessageType.TRAIN]
    assert len(train) == 2 * 2 and all(r.has_error() for r in train)
    assert silos["trained"] == 0 and silos["data"] == [] and _ledgers(grid, tmp_path) == ({}, {})
    assert [h["silos"] for h in strategy.history] == [0, 0]
    assert all("refused: silo" in d and "not a positive number" in d for d in strategy.dropped)


def test_with_reported_counts_a_silo_checks_what_it_can_derive(silos, tmp_path):
    """Reported counts (the paper's reproduction, not DP): z is calibrated on every
    silo's counts, which a silo does not have; it still holds the server to its own
    rate (batch-size over its size: 8 / 40), a fixed noise-multiplier, the plan's
    rounds and one release per round."""
    rc = dict(RC, **{"max-records-per-subject": 0, "noise-multiplier": 1.0})
    grid = _grid(tmp_path, rc)
    honest = {"noise-multiplier": 1.0, "calibration-steps": 2, "q": 0.2}
    assert all(not r.has_error() for r in _send(grid, 1, **honest))
    trained = silos["trained"]
    _refused(_send(grid, 2, **dict(honest, q=0.5)), "above the agreed 0.2 (from batch-size and this silo's size)")
    _refused(_send(grid, 2, **dict(honest, **{"noise-multiplier": 0.5})), "below the agreed noise-multiplier 1")
    _refused(_send(grid, 1, **honest), "round 1 was released already")
    _refused(_send(grid, 3, **honest), "outside the agreed 1..2")
    assert silos["trained"] == trained
    assert all(not r.has_error() for r in _send(grid, 2, **honest))


def test_one_guard_serves_owners_and_silos():
    assert owner_guard.AgreedRelease is guard.AgreedRelease and owner_guard.OwnerLedger is guard.PartyLedger
    assert owner_guard.InstructionRefused is guard.InstructionRefused
    assert issubclass(SiloAgreement, guard.AgreedRelease)


# ---------------------------------------------------------------- the budget is a hard stop


@pytest.mark.parametrize("over, keys", [
    ({"accounting": "sqrt-rounds", "num-silos": 4, "budget-rounds": 4},
     ["'accounting' = 'sqrt-rounds'", "'target-epsilon' = 4"]),
    ({"noise-multiplier": 0.3}, ["'noise-multiplier' = 0.3", "'budget-rounds' = 2", "'target-epsilon' = 4"]),
])
def test_a_plan_over_the_target_is_refused_at_start_up_and_by_every_silo(silos, tmp_path, over, keys):
    rc = dict(RC, **over)
    cfg = parse_subject_config(rc)
    assert make_plan(cfg).epsilon > cfg.target_epsilon
    grid = _grid(tmp_path, rc)
    with pytest.raises(ConfigError) as err:
        SubjectLevelFedAvg(cfg, _model()).start(grid)
    assert all(k in str(err.value) for k in keys), str(err.value)
    assert grid.sent == []  # refused before any node was contacted
    # a server that goes on anyway is refused by every silo, for the same reason
    plan = make_plan(cfg)
    replies = _send(grid, 1, **{"noise-multiplier": float(plan.noise_multiplier),
                                "calibration-steps": int(plan.calibration_steps)})
    _refused(replies, keys[0])
    assert silos["trained"] == 0 and _ledgers(grid, tmp_path) == ({}, {})


def test_a_plan_within_the_target_starts(silos, tmp_path):
    """The contrast: a fixed noise multiplier large enough for the rounds is accepted
    (sqrt-rounds too, when its exact epsilon is within the target)."""
    rc = dict(RC, **{"noise-multiplier": 50.0, "accounting": "sqrt-rounds"})
    grid = _grid(tmp_path, rc)
    strategy = SubjectLevelFedAvg(parse_subject_config(rc), _model())
    strategy.start(grid)
    assert strategy.status == "completed" and not strategy.dropped
    assert strategy.ledger.epsilon() <= 4.0


def test_report_batch_stats_is_refused_under_the_public_cap():
    with pytest.raises(ConfigError, match="'report-batch-stats' must be false with max-records-per-subject > 0"):
        parse_subject_config({"report-batch-stats": True})
    assert parse_subject_config({"report-batch-stats": True, "max-records-per-subject": 0}).report_batch_stats


@pytest.mark.parametrize("key, value", [("neighbouring", "replace-one"), ("secure-noise", True),
                                        ("secure-noise", "true")])
def test_joint_dp_noise_keys_are_refused_not_ignored(key, value):
    """Subject-level DP is add/remove with float32 noise: joint DP's ``neighbouring``
    and ``secure-noise`` are refused, naming the key, rather than silently ignored."""
    with pytest.raises(ConfigError, match=f"run-config key '{key}' must be .* for subject-level DP"):
        parse_subject_config({key: value})
    parse_subject_config({"neighbouring": "add-remove", "secure-noise": False})
