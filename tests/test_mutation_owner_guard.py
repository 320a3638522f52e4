"""Unit checks of the owner's own guard (flwr_jdp/joint_dp/owner_guard.py) that kill
mutants the in-process runs of tests/test_owner_guard.py leave alive or only kill
slowly: each bound of :meth:`AgreedRelease.check` at and just past its edge, the
event an owner charges, the fields :func:`agreed_release` derives, and the owner's
ledger (budget check, record, JSON and atomic save). docs/mutation.md."""

import json
import math

import dp_accounting as dpa
import pytest

from flwr_jdp.joint_dp.config import parse_config
from flwr_jdp.joint_dp.owner_guard import (
    SELF_SCOPE,
    TOLERANCE,
    AgreedRelease,
    Instruction,
    OwnerLedger,
    agreed_release,
)
from flwr_jdp.joint_dp.schedule import OwnerSize
from flwr_jdp.privacy import events as ev
from flwr_jdp.privacy.accountants import epsilon
from flwr_jdp.privacy.units import PrivacyUnit


def _agreed(**kw):
    base = dict(unit=PrivacyUnit.RECORD, max_sample_rate=0.1, max_steps=20, fixed_noise=1.0,
                rounds=3, budget=8.0, delta=1e-5, accountant="pld")
    base.update(kw)
    return AgreedRelease(**base)


def test_tolerance_is_tiny():
    assert 0 < TOLERANCE <= 1e-9


@pytest.mark.parametrize("z", [0.0, -1.0, math.nan, math.inf])
def test_a_non_positive_or_non_finite_noise_is_refused(z):
    reason = _agreed(fixed_noise=0.0).check(Instruction(1, 0.1, 20, z))
    assert reason is not None and "not a positive number" in reason


def test_sampling_rate_bounds():
    agreed = _agreed()
    assert agreed.check(Instruction(1, 0.1, 20, 1.0)) is None  # exactly the agreed rate
    assert agreed.check(Instruction(1, 0.1 * (1 + 0.5 * TOLERANCE), 20, 1.0)) is None  # rounding
    assert "sampling rate" in agreed.check(Instruction(1, 0.1 * (1 + 1e-6), 20, 1.0))
    assert "sampling rate" in agreed.check(Instruction(1, 0.0, 20, 1.0))
    assert "sampling rate" in agreed.check(Instruction(1, -0.1, 20, 1.0))
    assert "sampling rate" in agreed.check(Instruction(1, math.nan, 20, 1.0))
    assert "above the agreed 0.1 " in agreed.check(Instruction(1, 0.2, 20, 1.0))


def test_step_bounds():
    agreed = _agreed()
    assert agreed.check(Instruction(1, 0.1, 1, 1.0)) is None
    assert agreed.check(Instruction(1, 0.1, 20, 1.0)) is None
    assert agreed.check(Instruction(1, 0.1, 21, 1.0)) == "21 steps per round, agreed at most 20 (from local-epochs)"
    assert "steps per round" in agreed.check(Instruction(1, 0.1, 0, 1.0))


def test_owner_unit_ignores_rate_and_steps():
    agreed = _agreed(unit=PrivacyUnit.OWNER, max_sample_rate=0.0, max_steps=0)
    assert agreed.check(Instruction(1, 5.0, 1000, 1.0)) is None


def test_round_bounds():
    agreed = _agreed(rounds=3)
    assert agreed.check(Instruction(1, 0.1, 20, 1.0)) is None
    assert agreed.check(Instruction(3, 0.1, 20, 1.0)) is None
    assert agreed.check(Instruction(4, 0.1, 20, 1.0)) == "round 4 is outside the agreed 1..3 (num-rounds)"
    assert "outside the agreed" in agreed.check(Instruction(0, 0.1, 20, 1.0))


def test_fixed_noise_bound():
    agreed = _agreed(fixed_noise=1.0, budget=1e-6)  # a fixed z is checked against itself only
    assert agreed.check(Instruction(1, 0.1, 20, 1.0)) is None
    assert agreed.check(Instruction(1, 0.1, 20, 1.0 * (1 - 0.5 * TOLERANCE))) is None
    assert agreed.check(Instruction(1, 0.1, 20, 2.0)) is None
    reason = agreed.check(Instruction(1, 0.1, 20, 0.999))
    assert reason == "noise multiplier 0.999 is below the agreed noise-multiplier 1"


@pytest.mark.parametrize("unit", [PrivacyUnit.RECORD, PrivacyUnit.OWNER])
def test_calibrated_noise_is_checked_against_the_budget_over_all_rounds(unit):
    """With no fixed z, z is accepted iff ``rounds`` releases stay within the budget,
    computed with the owner's accountant and relation (the boundary is the exact
    epsilon of those rounds)."""
    kw = dict(unit=unit, fixed_noise=0.0, rounds=3, accountant="rdp")
    instr = Instruction(1, 0.1, 20, 1.0)
    one = _agreed(**kw).event(instr)
    spent = epsilon(dpa.SelfComposedDpEvent(one, 3), 1e-5, "rdp", "add-remove")
    assert _agreed(**dict(kw, budget=spent)).check(instr) is None
    assert _agreed(**dict(kw, budget=spent * (1 + 0.5 * TOLERANCE))).check(instr) is None
    reason = _agreed(**dict(kw, budget=spent * (1 - 1e-6))).check(instr)
    assert reason is not None and reason.startswith("noise multiplier 1 is too small: 3 rounds of it")
    assert f"epsilon {spent:.4f} > the owner's budget" in reason
    # two rounds of it fit a budget that three do not: the rounds enter the check
    two = epsilon(dpa.SelfComposedDpEvent(one, 2), 1e-5, "rdp", "add-remove")
    assert _agreed(**dict(kw, rounds=2, budget=two)).check(instr) is None
    if unit is PrivacyUnit.OWNER:  # the owner's own relation: replace-one spends more
        assert _agreed(**dict(kw, budget=spent, neighbouring="replace-one")).check(instr) is not None


def test_calibrated_check_uses_the_owners_accountant_and_delta():
    instr = Instruction(1, 0.1, 20, 1.0)
    agreed = _agreed(fixed_noise=0.0, accountant="rdp", delta=1e-3)
    spent = epsilon(dpa.SelfComposedDpEvent(agreed.event(instr), 3), 1e-3, "rdp", "add-remove")
    assert _agreed(fixed_noise=0.0, accountant="rdp", delta=1e-3, budget=spent).check(instr) is None
    assert _agreed(fixed_noise=0.0, accountant="rdp", delta=1e-3,
                   budget=spent * (1 - 1e-6)).check(instr) is not None


def test_event_of_each_unit():
    instr = Instruction(2, 0.25, 7, 1.5)
    assert ev.to_dict(_agreed(unit=PrivacyUnit.OWNER).event(instr)) == ev.to_dict(ev.gaussian(1.5))
    for unit in (PrivacyUnit.RECORD, PrivacyUnit.USER):
        assert ev.to_dict(_agreed(unit=unit).event(instr)) == ev.to_dict(ev.dp_sgd(1.5, 0.25, 7))


def test_agreed_release_fields_come_from_the_config_and_the_owners_size():
    cfg = parse_config({"batch-size": 16, "local-epochs": 2, "num-rounds": 3, "noise-multiplier": 1.25,
                        "target-epsilon": 6.0, "delta": 1e-4, "accountant": "rdp"})
    agreed = agreed_release(cfg, OwnerSize(160, 160))
    assert agreed == AgreedRelease(unit=PrivacyUnit.RECORD, max_sample_rate=pytest.approx(0.1),
                                   max_steps=20, fixed_noise=1.25, rounds=3, budget=6.0, delta=1e-4,
                                   accountant="rdp", neighbouring="add-remove")
    assert isinstance(agreed.max_steps, int) and isinstance(agreed.rounds, int)
    assert agreed_release(cfg, OwnerSize(160, 160), max_epsilon=2.5).budget == 2.5
    assert agreed_release(cfg, OwnerSize(160, 160), max_epsilon="2.5").budget == 2.5
    assert agreed_release(cfg, OwnerSize(160, 160), max_epsilon=60.0).budget == 6.0
    replace = parse_config({"noise-multiplier": 1.0, "neighbouring": "replace-one"})
    assert agreed_release(replace, OwnerSize(160, 160)).neighbouring == "replace-one"
    central = agreed_release(parse_config({"noise-placement": "central", "noise-multiplier": 1.0}), OwnerSize(10, 10))
    assert (central.max_sample_rate, central.max_steps, central.fixed_noise) == (1.0, 1, 1.0)
    with pytest.raises(ValueError, match="^distributed noise is agreed in flwr_jdp.joint_dp.distributed.agreed_distributed$"):
        agreed_release(parse_config({"noise-placement": "distributed", "num-owners": 3}), OwnerSize(10, 10))


def test_owner_ledger_save_is_atomic_in_the_target_folder(tmp_path, monkeypatch):
    import os

    ledger = OwnerLedger.from_json(None, _agreed(fixed_noise=0.0), "record")
    path = tmp_path / "a" / "b" / "owner.json"
    moves = []
    real_replace = os.replace

    def replace(src, dst):
        moves.append((src, dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    ledger.save(path)
    assert json.loads(path.read_text()) == json.loads(ledger.to_json())
    (src, dst), = moves
    assert os.path.dirname(src) == str(path.parent) and os.path.basename(src).startswith(".owner.json-")
    assert str(dst) == str(path)


def test_owner_ledger_checks_records_and_round_trips(tmp_path):
    agreed = _agreed(fixed_noise=0.0, budget=3.0, accountant="rdp", delta=1e-4)
    event = ev.gaussian(2.0)
    one = epsilon(event, 1e-4, "rdp", "add-remove")
    ledger = OwnerLedger.from_json(None, agreed, "record")
    assert ledger.releases == 0 and ledger.epsilon() == 0.0
    assert ledger.ledger.budget == 3.0 and ledger.ledger.delta == 1e-4
    assert ledger.ledger.accountant == "rdp" and ledger.ledger.unit == "record"
    assert ledger.check(event) is None
    ledger.record(4, event, note="n")
    assert ledger.releases == 1 and ledger.ledger.rounds[0]["round"] == 4
    assert ledger.ledger.rounds[0]["note"] == "n"
    assert ledger.epsilon() == pytest.approx(one)
    assert list(ledger.ledger.scopes) == [SELF_SCOPE]
    text = ledger.to_json()
    again = OwnerLedger.from_json(text, agreed, "record")
    assert again.releases == 1 and again.epsilon() == pytest.approx(one)
    big = ev.gaussian(0.05)
    reason = again.check(big)
    would = again.ledger.epsilon({SELF_SCOPE: big})
    assert reason == f"releasing would spend epsilon {would:.4f} > the owner's budget 3 (1 rounds released)"
    fresh = OwnerLedger.from_json(None, agreed, "record")
    fresh.record(5, ev.gaussian(50.0))
    assert fresh.ledger.rounds[-1]["note"] == ""
    path = tmp_path / "sub" / "ledger.json"
    again.save(path)
    assert json.loads(path.read_text()) == json.loads(text)
    assert [p.name for p in path.parent.iterdir()] == ["ledger.json"]  # no temporary left
    again.save(path)  # overwrites
    assert OwnerLedger.from_json(path.read_text(), agreed, "record").releases == 1
    assert again.releases == 1


def test_owner_ledger_keeps_the_relation_and_refuses_a_mismatch():
    agreed = _agreed(fixed_noise=0.0, neighbouring="replace-one", accountant="rdp")
    ledger = OwnerLedger.from_json(None, agreed, "user")
    assert ledger.ledger.neighbouring == "replace-one" and ledger.ledger.unit == "user"
    with pytest.raises(ValueError):
        OwnerLedger.from_json(ledger.to_json(), _agreed(fixed_noise=0.0, accountant="rdp"), "user")
    assert OwnerLedger(1.0, 1e-5, "pld", "record").ledger.neighbouring == "add-remove"
    direct = OwnerLedger(1.0, 1e-5, "pld", "record", state={}, neighbouring="add-remove")
    assert direct.ledger.scopes == {} and direct.ledger.budget == 1.0
