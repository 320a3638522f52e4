"""Unit tests of the generic privacy accounting (events, accountants, RDP, calibration,
ledger) against dp-accounting computed directly: each checks one value or rule that a
mutant of ``flwr_jdp/privacy/`` would change (docs/mutation.md). All use small
Gaussian events, so every PLD here takes milliseconds."""

from __future__ import annotations

import json
import math
import os

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

from flwr_jdp.privacy import accountants as acc
from flwr_jdp.privacy import calibration as cal
from flwr_jdp.privacy import events as ev
from flwr_jdp.privacy import rdp
from flwr_jdp.privacy.ledger import SERVER_SCOPE, PrivacyLedger, owner_scope

DELTA = 1e-5


def pld_reference(event: dpa.DpEvent, delta: float = DELTA, relation: str = "add-remove",
                  discretization: float = 1e-4) -> float:
    rel = (dpa.NeighboringRelation.REPLACE_ONE if relation == "replace-one"
           else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    a = PLDAccountant(neighboring_relation=rel, value_discretization_interval=discretization)
    a.compose(event)
    return float(a.get_epsilon(delta))


def G(z: float) -> dpa.DpEvent:  # noqa: N802
    return dpa.GaussianDpEvent(z)


def poisson(q: float, z: float) -> dpa.DpEvent:
    return dpa.PoissonSampledDpEvent(q, G(z))


# ------------------------------------------------------------------------- events
def test_event_constructors():
    assert ev.gaussian(2) == G(2.0) and isinstance(ev.gaussian(2).noise_multiplier, float)
    assert ev.dp_sgd(1.0, 0.5, 0) == dpa.NoOpDpEvent()
    assert ev.dp_sgd(1.0, 0.5, -3) == dpa.NoOpDpEvent()
    assert ev.dp_sgd(1.5, 1.0, 1) == G(1.5)  # rate 1: no amplification claimed
    assert ev.dp_sgd(1.5, 2.0, 1) == G(1.5)
    assert ev.dp_sgd(1.5, 0.25, 1) == poisson(0.25, 1.5)
    assert ev.dp_sgd(1.5, 0.25, 4) == dpa.SelfComposedDpEvent(poisson(0.25, 1.5), 4)
    assert ev.dp_sgd(1.5, 1.0, 2) == dpa.SelfComposedDpEvent(G(1.5), 2)
    assert ev.compose([]) == dpa.NoOpDpEvent()
    assert ev.compose([dpa.NoOpDpEvent(), dpa.NoOpDpEvent()]) == dpa.NoOpDpEvent()
    assert ev.compose([dpa.NoOpDpEvent(), G(1.0)]) == G(1.0)
    assert ev.compose([G(1.0), dpa.NoOpDpEvent(), G(2.0)]) == dpa.ComposedDpEvent([G(1.0), G(2.0)])


def test_event_codec_round_trips_and_is_canonical():
    nested = dpa.SelfComposedDpEvent(dpa.ComposedDpEvent([poisson(0.1, 1.2), dpa.LaplaceDpEvent(3.0)]), 5)
    data = ev.to_dict(nested)
    assert data["class_name"] == "SelfComposedDpEvent" and data["count"] == 5
    assert data["event"]["events"][0] == {"class_name": "PoissonSampledDpEvent", "sampling_probability": 0.1,
                                          "event": {"class_name": "GaussianDpEvent", "noise_multiplier": 1.2}}
    assert "module_name" not in json.dumps(data)
    assert ev.from_dict(data) == nested
    assert ev.from_dict(json.loads(json.dumps(data))) == nested
    assert ev.from_dict([1, {"a": 2}]) == [1, {"a": 2}]
    data["count"] = 6  # a fresh dict: the cache is not touched
    assert ev.to_dict(nested)["count"] == 5
    assert ev.canonical(G(1.0)) == '{"class_name": "GaussianDpEvent", "noise_multiplier": 1.0}'
    composed = dpa.ComposedDpEvent([G(1.0), G(2.0)])  # unhashable: not cached
    assert json.loads(ev.canonical(composed)) == ev.to_dict(composed)
    assert ev.canonical(composed) == json.dumps(json.loads(ev.canonical(composed)), sort_keys=True)
    # keys sorted (not the attrs field order), so equal events give equal strings
    assert ev.canonical(poisson(0.1, 1.2)) == ('{"class_name": "PoissonSampledDpEvent", "event": '
                                               '{"class_name": "GaussianDpEvent", "noise_multiplier": 1.2}, '
                                               '"sampling_probability": 0.1}')


# -------------------------------------------------------------------- accountants
def test_checks_name_the_allowed_values():
    assert acc.check_accountant("rdp") == "rdp" and acc.check_relation("replace-one") == "replace-one"
    with pytest.raises(ValueError, match=r"accountant must be one of .*'pld'.*got 'x'"):
        acc.check_accountant("x")
    with pytest.raises(ValueError, match=r"neighbouring relation must be one of .*got 'y'"):
        acc.check_relation("y")
    with pytest.raises(ValueError):
        acc.epsilon(G(1.0), DELTA, "x")
    with pytest.raises(ValueError):
        acc.epsilon(G(1.0), DELTA, "pld", "y")


def test_replace_one_is_add_remove_with_half_the_noise_for_unsampled_releases():
    assert acc.as_add_remove(G(2.0)) == G(1.0)
    assert acc.as_add_remove(dpa.LaplaceDpEvent(3.0)) == dpa.LaplaceDpEvent(1.5)
    assert acc.as_add_remove(dpa.SelfComposedDpEvent(G(2.0), 3)) == dpa.SelfComposedDpEvent(G(1.0), 3)
    assert acc.as_add_remove(dpa.ComposedDpEvent([G(2.0), dpa.LaplaceDpEvent(4.0)])) == \
        dpa.ComposedDpEvent([G(1.0), dpa.LaplaceDpEvent(2.0)])
    assert acc.as_add_remove(poisson(0.1, 2.0)) == poisson(0.1, 2.0)
    for accountant in ("pld", "rdp"):
        assert acc.epsilon(G(2.0), DELTA, accountant, "replace-one") == \
            pytest.approx(acc.epsilon(G(1.0), DELTA, accountant), rel=1e-12)
    sampled = dpa.SelfComposedDpEvent(poisson(0.2, 2.0), 3)
    assert acc.epsilon(sampled, DELTA, "pld", "replace-one") == \
        pytest.approx(pld_reference(sampled, relation="replace-one"), rel=1e-6)
    assert acc.epsilon(sampled, DELTA, "pld", "replace-one") > acc.epsilon(sampled, DELTA, "pld")
    with pytest.raises(ValueError, match=r"^RDP of Poisson-sampled releases under replace-one is not "
                       r"supported; use the pld accountant$"):
        acc.epsilon(sampled, DELTA, "rdp", "replace-one")


def test_pld_epsilon_equals_dp_accounting():
    assert acc.epsilon(dpa.NoOpDpEvent(), DELTA) == 0.0
    assert acc.epsilon(dpa.NoOpDpEvent(), DELTA, "rdp") == 0.0
    for event in (G(2.0), dpa.SelfComposedDpEvent(G(3.0), 5), poisson(0.3, 2.0),
                  dpa.ComposedDpEvent([G(2.5), dpa.SelfComposedDpEvent(poisson(0.2, 2.0), 4), G(3.0)])):
        assert acc.epsilon(event, DELTA) == pytest.approx(pld_reference(event), rel=2e-3)
        assert acc.epsilon(event, 1e-3) == pytest.approx(pld_reference(event, 1e-3), rel=2e-3)
    # the coarse grid is an upper bound and looser; the fine one is the default
    e = dpa.SelfComposedDpEvent(poisson(0.2, 2.0), 4)
    coarse = acc.epsilon(e, DELTA, discretization=acc.PLD_COARSE_DISCRETIZATION)
    assert coarse == pytest.approx(pld_reference(e, discretization=1e-3), rel=1e-6)
    assert acc.epsilon(e, DELTA) == pytest.approx(pld_reference(e, discretization=1e-4), rel=1e-6)
    assert acc.PLD_DISCRETIZATION == 1e-4 and acc.PLD_COARSE_DISCRETIZATION == 1e-3


def test_base_counts_flatten_sequential_composition():
    event = dpa.SelfComposedDpEvent(
        dpa.ComposedDpEvent([G(1.0), dpa.SelfComposedDpEvent(G(2.0), 2), dpa.NoOpDpEvent(), G(1.0)]), 3)
    assert acc.base_counts(event) == {ev.canonical(G(1.0)): 6, ev.canonical(G(2.0)): 6}
    assert acc.base_counts(dpa.NoOpDpEvent()) == {}
    assert acc.base_counts(G(1.0), count=4) == {ev.canonical(G(1.0)): 4}
    out = {ev.canonical(G(1.0)): 1}
    assert acc.base_counts(G(1.0), out=out) is out and out[ev.canonical(G(1.0))] == 2


def test_rdp_epsilon_equals_dp_accounting_and_opacus_bound():
    event = dpa.ComposedDpEvent([dpa.SelfComposedDpEvent(G(2.0), 3), G(4.0)])
    ref = RdpAccountant(rdp.ORDERS)
    ref.compose(event)
    assert acc.epsilon(event, DELTA, "rdp") == pytest.approx(ref.get_epsilon(DELTA), rel=1e-9)
    assert rdp.rdp_vector(dpa.NoOpDpEvent()).shape == (len(rdp.ORDERS),)
    assert not rdp.rdp_vector(dpa.NoOpDpEvent()).any()
    np.testing.assert_allclose(rdp.rdp_vector(dpa.SelfComposedDpEvent(G(2.0), 3)),
                               3 * rdp.rdp_vector(G(2.0)))
    np.testing.assert_allclose(rdp.rdp_vector(event, [2.0, 8.0]),
                               [3 * 2 / (2 * 4) + 2 / (2 * 16), 3 * 8 / (2 * 4) + 8 / (2 * 16)])
    # Opacus's reference value for the subsampled Gaussian
    opacus = dpa.SelfComposedDpEvent(poisson(0.04, 1.5), 2250)
    assert acc.epsilon(opacus, 1e-5, "rdp") == pytest.approx(7.32911, abs=2e-4)
    assert 1.0 + 0.1 in rdp.ORDERS and 63 in rdp.ORDERS and 256.0 in rdp.ORDERS
    vec = rdp.rdp_vector(poisson(0.04, 1.5))
    assert compute_epsilon(rdp.ORDERS, 2250 * vec, 1e-5)[0] == pytest.approx(7.32911, abs=2e-4)


def test_screened_maximum_is_the_largest_ledger_epsilon():
    events = [dpa.SelfComposedDpEvent(G(z), 3) for z in (4.0, 1.5, 3.0, 2.0, 6.0)]
    exact = [acc.epsilon(e, DELTA) for e in events]
    value, index, settled = acc.screened_max_epsilon(events, DELTA)
    assert index == 1 and value == exact[1] and settled[1] == exact[1]
    assert all(settled[j] == exact[j] for j in settled)
    value, index, settled = acc.screened_max_epsilon(events, DELTA, floor=100.0)
    assert (value, index, settled) == (100.0, -1, {})
    value, index, settled = acc.screened_max_epsilon(events[:2], DELTA)
    assert (value, index) == (exact[1], 1) and settled == {0: exact[0], 1: exact[1]}
    value, index, settled = acc.screened_max_epsilon(events[:1], DELTA, floor=0.0)
    assert (value, index, settled) == (exact[0], 0, {0: exact[0]})
    # equal maxima: the first one computed is kept; a value below the floor is not chosen
    value, index, _ = acc.screened_max_epsilon([events[0], events[1], events[1]], DELTA,
                                               floor=exact[1] + 1.0)
    assert (value, index) == (exact[1] + 1.0, -1)
    value, index, _ = acc.screened_max_epsilon([events[4], events[0], events[2], events[1]], DELTA)
    assert (value, index) == (exact[1], 3)


# -------------------------------------------------------------------- calibration
def test_pld_grid_is_the_ledger_grid_up_to_ten():
    assert cal.pld_grid(0.5) == cal.pld_grid(10.0) == acc.PLD_DISCRETIZATION
    assert cal.pld_grid(10.5) == pytest.approx(11 * acc.PLD_DISCRETIZATION)
    assert cal.pld_grid(40.0) == pytest.approx(40 * acc.PLD_DISCRETIZATION)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_calibrated_multiplier_meets_the_target_from_below(accountant):
    def events(z: float) -> dpa.DpEvent:
        return dpa.SelfComposedDpEvent(G(z), 10)

    z = cal.calibrate(2.0, DELTA, events, accountant, rel_tol=0.005)
    eps = acc.epsilon(events(z), DELTA, accountant)
    assert 2.0 * (1 - 0.005) <= eps <= 2.0
    assert acc.epsilon(events(z * 0.99), DELTA, accountant) > 2.0
    # several events: the largest decides
    z2 = cal.calibrate(2.0, DELTA, lambda z: [events(z), dpa.SelfComposedDpEvent(G(z), 20)], accountant)
    eps2 = acc.epsilon(dpa.SelfComposedDpEvent(G(z2), 20), DELTA, accountant)
    assert 2.0 * (1 - 0.005) <= eps2 <= 2.0 and z2 > z
    # replace-one: twice the multiplier of add/remove (unsampled Gaussian)
    z3 = cal.calibrate(2.0, DELTA, events, accountant, relation="replace-one")
    assert z3 == pytest.approx(2 * z, rel=0.02)


def test_calibration_of_sampled_replace_one_releases_and_its_limits():
    def events(z: float) -> dpa.DpEvent:
        return dpa.SelfComposedDpEvent(poisson(0.3, z), 3)

    z = cal.calibrate(1.0, DELTA, events, "pld", relation="replace-one")
    eps = acc.epsilon(events(z), DELTA, "pld", "replace-one")
    assert 1.0 * (1 - 0.005) <= eps <= 1.0
    with pytest.raises(ValueError, match="target epsilon must be > 0"):
        cal.calibrate(0.0, DELTA, events)
    with pytest.raises(ValueError, match="unreachable"):
        cal.calibrate(1e-6, DELTA, lambda z: dpa.SelfComposedDpEvent(G(z), 100), "rdp")
    assert cal.calibrate(1e4, DELTA, lambda z: G(z), "rdp") == cal.MIN_NOISE_MULTIPLIER
    assert cal.calibrate(1e4, DELTA, lambda z: G(z), "pld") == cal.MIN_NOISE_MULTIPLIER
    assert cal.MIN_NOISE_MULTIPLIER == 0.05 and cal.MAX_NOISE_MULTIPLIER == 1e4


def test_bisection_and_narrowing_on_a_known_curve():
    eps = _Capped(lambda z: 1.0 / z)

    z = cal._bisect(eps, eps, 2.0, 0.001)
    assert 2.0 * (1 - 0.001) <= eps(z) <= 2.0
    z = cal._bisect(eps, lambda z: 2.0 / z, 0.1, 0.001)  # a looser bracket bound
    assert 0.1 * (1 - 0.001) <= eps(z) <= 0.1
    assert cal._bisect(eps, eps, 100.0, 0.001) == cal.MIN_NOISE_MULTIPLIER
    hi = cal._narrow(eps, 0.25, 1.0, 2.0, 0.01)
    assert 2.0 * 0.99 <= eps(hi) <= 2.0
    hi = cal._narrow(eps, 0.49999999, 0.50000001, 2.0, 0.0)  # stops on the bracket width
    assert hi == pytest.approx(0.5, abs=1e-7) and eps(hi) <= 2.0
    with pytest.raises(ValueError, match="unreachable"):
        cal._bisect(_Capped(lambda z: 1e9), _Capped(lambda z: 1e9), 1.0, 0.01)


# ------------------------------------------------------------------------- ledger
def test_ledger_arguments_are_checked():
    for delta in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="delta must be in"):
            PrivacyLedger(delta=delta)
    PrivacyLedger(delta=0.5)
    with pytest.raises(ValueError):
        PrivacyLedger(delta=DELTA, accountant="x")
    with pytest.raises(ValueError):
        PrivacyLedger(delta=DELTA, neighbouring="y")
    assert owner_scope(3) == "owner/3" and owner_scope("4") == "owner/4" and SERVER_SCOPE == "server"
    ledger = PrivacyLedger(delta=DELTA)
    assert (ledger.accountant, ledger.unit, ledger.budget, ledger.neighbouring) == \
        ("pld", "record", None, "add-remove")


def test_ledger_merges_equal_consecutive_events():
    ledger = PrivacyLedger(delta=DELTA)
    ledger.record("a", dpa.NoOpDpEvent())
    assert ledger.scopes == {}
    ledger.record("a", G(1.0))
    ledger.record("a", G(1.0))
    ledger.record("a", G(2.0))
    ledger.record("a", G(1.0))
    assert ledger.scopes["a"] == [[ev.to_dict(G(1.0)), 2], [ev.to_dict(G(2.0)), 1], [ev.to_dict(G(1.0)), 1]]
    expected = dpa.ComposedDpEvent([dpa.SelfComposedDpEvent(G(1.0), 2), G(2.0), G(1.0)])
    assert ledger.scope_event("a") == expected
    assert ledger.scope_event("a", G(1.0)) == \
        dpa.ComposedDpEvent([dpa.SelfComposedDpEvent(G(1.0), 2), G(2.0), dpa.SelfComposedDpEvent(G(1.0), 2)])
    assert ledger.scope_event("a", dpa.NoOpDpEvent()) == expected
    assert ledger.scope_event("b", G(3.0)) == G(3.0)
    assert ledger.scope_event("b") == dpa.NoOpDpEvent()
    assert ledger.scope_epsilon("a") == pytest.approx(pld_reference(expected), rel=2e-3)
    assert ledger.scopes["a"][0][1] == 2  # asking about a planned event records nothing


def test_ledger_epsilon_is_the_maximum_over_scopes_with_planned_releases():
    ledger = PrivacyLedger(delta=DELTA)
    assert ledger.epsilon() == 0.0
    assert ledger.epsilon({}) == 0.0
    ledger.record(owner_scope(1), G(4.0))
    ledger.record(owner_scope(2), G(3.0))
    e1, e2 = pld_reference(G(4.0)), pld_reference(G(3.0))
    assert ledger.epsilon() == pytest.approx(max(e1, e2), rel=1e-6)
    planned = {owner_scope(1): dpa.SelfComposedDpEvent(G(4.0), 9)}
    assert ledger.epsilon(planned) == pytest.approx(pld_reference(dpa.SelfComposedDpEvent(G(4.0), 10)), rel=1e-3)
    assert ledger.epsilon({"new": G(1.5)}) == pytest.approx(pld_reference(G(1.5)), rel=1e-6)
    assert ledger.epsilon() == pytest.approx(max(e1, e2), rel=1e-6)  # planned is not recorded
    # many distinct scopes: the screened maximum equals the largest one
    for k, z in enumerate((6.0, 2.7, 10.0, 3.6)):
        ledger.record(f"s/{k}", G(z))
    assert ledger.epsilon() == pytest.approx(pld_reference(G(2.7)), rel=1e-6)
    assert ledger.epsilon() == pytest.approx(pld_reference(G(2.7)), rel=1e-6)  # cached
    assert ledger.epsilon({"s/1": G(2.7)}) == \
        pytest.approx(pld_reference(dpa.SelfComposedDpEvent(G(2.7), 2)), rel=1e-3)
    rdp_ledger = PrivacyLedger(delta=DELTA, accountant="rdp")
    for k, z in enumerate((6.0, 2.7, 10.0, 3.6)):
        rdp_ledger.record(f"s/{k}", G(z))
    assert rdp_ledger.epsilon() == pytest.approx(acc.epsilon(G(2.7), DELTA, "rdp"), rel=1e-9)
    ro = PrivacyLedger(delta=DELTA, neighbouring="replace-one")
    for k, z in enumerate((12.0, 5.4, 20.0, 7.2)):
        ro.record(f"s/{k}", G(z))
    assert ro.epsilon() == pytest.approx(pld_reference(G(2.7)), rel=1e-6)
    assert ro.scope_epsilon("s/1") == pytest.approx(pld_reference(G(2.7)), rel=1e-6)


def test_record_round_logs_each_round_with_the_epsilon_after_it():
    ledger = PrivacyLedger(delta=DELTA)
    ledger.record_round(3, {"a": G(1.0), "b": G(2.0)}, note="x")
    ledger.record_round(4.0, {"a": G(1.0)})
    assert ledger.rounds[0] == {"round": 3, "scopes": 2, "note": "x",
                                "epsilon": pytest.approx(pld_reference(G(1.0)), rel=1e-6)}
    assert ledger.rounds[1]["round"] == 4 and isinstance(ledger.rounds[1]["round"], int)
    assert ledger.rounds[1]["scopes"] == 1 and ledger.rounds[1]["note"] == ""
    assert ledger.rounds[1]["epsilon"] == pytest.approx(pld_reference(dpa.SelfComposedDpEvent(G(1.0), 2)),
                                                        rel=1e-3)


def test_would_exceed_compares_with_the_budget_after_the_planned_release():
    ledger = PrivacyLedger(delta=DELTA)
    ledger.record("a", G(1.0))
    after = ledger.epsilon({"a": G(1.0)})
    assert not ledger.would_exceed({"a": G(1.0)})  # no budget
    ledger.budget = math.inf
    assert not ledger.would_exceed({"a": G(1.0)})
    ledger.budget = after
    assert not ledger.would_exceed({"a": G(1.0)})  # at the budget exactly
    ledger.budget = after * (1 - 1e-6)
    assert ledger.would_exceed({"a": G(1.0)})
    assert not ledger.would_exceed({"a": G(1.0)}, budget=after * 1.001)
    assert ledger.would_exceed({"a": G(1.0)}, budget=after * 0.99)
    ledger.budget = None
    assert ledger.would_exceed({"a": G(1.0)}, budget=after * 0.99)


def test_ledger_saves_atomically_and_loads_what_it_saved(tmp_path):
    ledger = PrivacyLedger(delta=1e-6, accountant="pld", unit="user", budget=4.0, neighbouring="replace-one")
    ledger.record_round(1, {"a": G(2.0), "b": poisson(0.1, 1.0)}, note="r1")
    ledger.record_round(2, {"a": G(2.0)})
    state = ledger.state_dict()
    assert state["version"] == 1 and state["delta"] == 1e-6 and state["unit"] == "user"
    assert state["budget"] == 4.0 and state["neighbouring"] == "replace-one" and state["accountant"] == "pld"
    assert state["epsilon"] == ledger.epsilon() and state["scopes"] == ledger.scopes
    assert state["rounds"] == ledger.rounds
    path = tmp_path / "deep" / "ledger.json"
    ledger.save(path)
    assert os.listdir(path.parent) == ["ledger.json"]  # no temporary file left
    assert (os.stat(path).st_mode & 0o777) == 0o644
    assert json.loads(path.read_text()) == json.loads(json.dumps(state))
    back = PrivacyLedger.load(path)
    assert (back.delta, back.accountant, back.unit, back.budget, back.neighbouring) == \
        (1e-6, "pld", "user", 4.0, "replace-one")
    assert back.scopes == ledger.scopes and back.rounds == ledger.rounds
    assert back.epsilon() == ledger.epsilon()
    back.record("a", G(2.0))  # counts stay integers and merge after a load
    assert back.scopes["a"] == [[ev.to_dict(G(2.0)), 3]]


def test_loading_another_runs_ledger_is_refused_naming_the_field(tmp_path):
    ledger = PrivacyLedger(delta=DELTA, unit="user")
    ledger.record("a", G(1.0))
    state = ledger.state_dict()
    for key, value in (("delta", 1e-6), ("accountant", "rdp"), ("unit", "record"), ("neighbouring", "replace-one")):
        other = PrivacyLedger(delta=DELTA, unit="user")
        setattr(other, key, value)
        with pytest.raises(ValueError, match=rf"ledger on disk has {key}=.*this run has {key}="):
            other.load_state_dict(state)
    old = {k: v for k, v in state.items() if k not in ("neighbouring", "rounds")}  # before those fields
    other = PrivacyLedger(delta=DELTA, unit="user")
    other.load_state_dict(old)
    assert other.scopes == ledger.scopes and other.rounds == []
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    assert PrivacyLedger.load(path).neighbouring == "add-remove"
    with pytest.raises(ValueError):
        PrivacyLedger(delta=DELTA, unit="user", neighbouring="replace-one").load_state_dict(old)


# ------------------------------------------------------------ horizontal composition
def test_subject_inclusion_rates():
    from flwr_jdp.privacy.horizontal import SiloRelease, subject_inclusion_rate

    assert subject_inclusion_rate(0.1, 0) == 0.0 and subject_inclusion_rate(0.1, -1) == 0.0
    assert subject_inclusion_rate(1.0, 3) == 1.0 and subject_inclusion_rate(1.5, 2) == 1.0
    assert subject_inclusion_rate(0.1, 1) == pytest.approx(0.1, rel=1e-12)
    assert subject_inclusion_rate(0.1, 3) == pytest.approx(1 - 0.9 ** 3, rel=1e-12)
    rec = SiloRelease(0.2, 1.0, 2)
    assert rec.inclusion_rate(0) == 0.0 and rec.inclusion_rate(-2) == 0.0
    assert rec.inclusion_rate(2) == pytest.approx(1 - 0.8 ** 2, rel=1e-12)
    sub = SiloRelease(0.2, 1.0, 2, sampling="subjects")
    assert sub.inclusion_rate(5) == 0.2 and sub.inclusion_rate(1) == 0.2 and sub.inclusion_rate(0) == 0.0
    assert SiloRelease(1.5, 1.0, 2, sampling="subjects").inclusion_rate(3) == 1.0
    assert (rec.amplified, rec.sampling) == (True, "records")


def test_silo_release_events():
    from flwr_jdp.privacy.horizontal import SiloRelease

    rel = SiloRelease(0.2, 1.5, 3)
    noop = dpa.NoOpDpEvent()
    assert rel.subject_event(0, 2) == noop and rel.subject_event(2, 0) == noop
    assert SiloRelease(0.2, 1.5, 0).subject_event(2, 2) == noop
    two = rel.subject_event(2, 2)
    assert two.count == 6 and two.event.event == G(1.5)
    assert two.event.sampling_probability == pytest.approx(1 - 0.8 ** 2, rel=1e-12)
    assert rel.subject_event(1, 1) == dpa.SelfComposedDpEvent(poisson(0.2, 1.5), 3)
    assert SiloRelease(1.0, 1.5, 3).subject_event(2, 2) == dpa.SelfComposedDpEvent(G(1.5), 6)
    assert SiloRelease(0.2, 1.5, 3, amplified=False).subject_event(2, 2) == dpa.SelfComposedDpEvent(G(1.5), 6)
    assert SiloRelease(0.2, 1.5, 1).subject_event(1, 1) == dpa.SelfComposedDpEvent(poisson(0.2, 1.5), 1)


def test_pareto_maximal_rows_and_accountant_arguments():
    from flwr_jdp.privacy.horizontal import HorizontalAccountant, pareto_maximal

    rows = np.array([[1, 2], [2, 2], [2, 1], [0, 0], [2, 2], [1, 3]])
    assert pareto_maximal(rows).tolist() == [1, 5]
    assert pareto_maximal(np.array([[1, 1], [1, 1]])).tolist() == [0]
    assert pareto_maximal(np.array([[0, 3], [3, 0]])).tolist() == [0, 1]
    assert pareto_maximal(rows).dtype == np.int64
    for bad in (np.array([1, 2]), np.array([[1, -1]])):
        with pytest.raises(ValueError, match=r"counts must be a \(subjects, silos\) array"):
            HorizontalAccountant(bad, DELTA)
    a = HorizontalAccountant([[1, 0], [2, 1]], 1e-5)
    assert a.counts.dtype == np.int64 and a.delta == 1e-5 and isinstance(a.delta, float)
    assert a.accountant == "pld" and a.num_silos == 2 and a.candidates.tolist() == [1]
    assert a.worst_counts().tolist() == [2, 1]
    assert HorizontalAccountant(np.zeros((3, 4), dtype=int), DELTA).num_silos == 4


def _horizontal(accountant: str = "pld"):
    from flwr_jdp.privacy.horizontal import HorizontalAccountant, SiloRelease

    counts = np.array([[1, 0, 0], [2, 1, 0], [1, 0, 0], [0, 0, 3]])
    releases = [SiloRelease(q, 3.0, 2) for q in (1.0, 1.0, 0.5)]
    return HorizontalAccountant(counts, DELTA, accountant), releases


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_horizontal_epsilons_compose_the_silos_of_each_subject(accountant):
    a, rel = _horizontal(accountant)

    def direct(row):
        return acc.epsilon(ev.compose([r.subject_event(int(k), 2) for k, r in zip(row, rel)]), DELTA, accountant)

    assert a.subject_event([2, 1, 0], rel, 2) == dpa.ComposedDpEvent(
        [rel[0].subject_event(2, 2), rel[1].subject_event(1, 2)])
    assert a.s_fold_event(rel, 2) == dpa.ComposedDpEvent([rel[i].subject_event(k, 2) for i, k in enumerate((2, 1, 3))])
    per = a.subject_epsilons(rel, 2)
    expected = [direct(r) for r in a.counts]
    np.testing.assert_allclose(per, expected, rtol=1e-9)
    assert per[0] == per[2] and per.shape == (4,)
    assert a.epsilon(rel, 2) == pytest.approx(max(expected), rel=1e-9)
    subject, eps = a.worst_subject(rel, 2)
    assert subject == int(np.argmax(expected)) and eps == pytest.approx(max(expected), rel=1e-9)
    assert a.s_fold_epsilon(rel, 2) == pytest.approx(direct([2, 1, 3]), rel=1e-9)
    assert a.s_fold_epsilon(rel, 2) > a.epsilon(rel, 2)
    single = max(acc.epsilon(r.subject_event(k, 2), DELTA, accountant) for r, k in zip(rel, (2, 1, 3)))
    assert a.single_silo_epsilon(rel, 2) == pytest.approx(single, rel=1e-9)
    from flwr_jdp.privacy.horizontal import HorizontalAccountant
    assert HorizontalAccountant(np.zeros((0, 3), dtype=int), DELTA, accountant).epsilon(rel, 2) == 0.0


def test_horizontal_calibration_meets_the_target_in_each_mode():
    from flwr_jdp.privacy.horizontal import SiloRelease

    a, _ = _horizontal("rdp")

    def releases_of(z):
        return [SiloRelease(1.0, z, 2 + i) for i in range(3)]

    with pytest.raises(ValueError, match="accounting must be one of"):
        a.calibrate(2.0, 2, releases_of, "nope")
    z = a.calibrate(2.0, 2, releases_of)  # exact, the default
    assert 2.0 * 0.99 <= a.epsilon(releases_of(z), 2) <= 2.0
    z_s = a.calibrate(2.0, 2, releases_of, "scaled-steps")
    assert 2.0 * 0.99 <= a.s_fold_epsilon(releases_of(z_s), 2) <= 2.0 and z_s > z
    z_q = a.calibrate(2.0, 2, releases_of, "sqrt-rounds")
    assert 2.0 * 0.99 <= a.single_silo_epsilon(releases_of(z_q), 2) <= 2.0 and z_q < z
    p, _ = _horizontal("pld")
    zp = p.calibrate(2.0, 2, releases_of)
    assert 2.0 * 0.99 <= p.epsilon(releases_of(zp), 2) <= 2.0


def test_max_rounds_is_the_last_round_within_the_target():
    from flwr_jdp.privacy.horizontal import SiloRelease, sqrt_rounds

    a, _ = _horizontal("rdp")
    rel = [SiloRelease(1.0, 3.0, 2 + i) for i in range(3)]
    target = a.epsilon(rel, 5) * 1.0001
    assert a.max_rounds(target, rel) == 5
    assert a.epsilon(rel, 6) > target
    assert a.max_rounds(a.epsilon(rel, 1) * 0.5, rel) == 0
    assert a.max_rounds(a.epsilon(rel, 1) * 1.0001, rel) == 1
    t_s = a.s_fold_epsilon(rel, 3) * 1.0001
    assert a.max_rounds(t_s, rel, bound="s-fold") == 3
    huge = [SiloRelease(1.0, 1e3, 1) for _ in range(3)]
    assert a.max_rounds(10.0, huge, limit=20) == 20
    assert a.max_rounds(10.0, huge, limit=16) == 16
    assert sqrt_rounds(10, 4) == 5 and sqrt_rounds(10, 3) == 5 and sqrt_rounds(1, 100) == 1
    assert sqrt_rounds(9, 1) == 9


# ------------------------------------------------ calibration's two stages, on a known curve
def _curve(monkeypatch, fine_factor: float = 1.0, calls: list | None = None):
    """``epsilon(G(z)) = 1/z`` on every grid and by RDP, times ``fine_factor`` on the
    ledger's (fine) PLD grid; records (backend, grid) of every evaluation."""
    calls = [] if calls is None else calls

    def fake(event, delta, backend="pld", relation="add-remove", discretization=acc.PLD_DISCRETIZATION):
        calls.append((backend, discretization))
        if len(calls) > 5000:  # a search that does not end fails instead of hanging
            raise RuntimeError("the search does not end")
        value = 1.0 / event.noise_multiplier
        if backend == "rdp":
            return value * 1.5  # RDP: looser
        return value * (fine_factor if discretization == cal.pld_grid(2.0) else 1.0)

    monkeypatch.setattr(cal, "epsilon", fake)
    return calls


def test_second_stage_keeps_the_coarse_answer_when_the_fine_grid_agrees(monkeypatch):
    calls = _curve(monkeypatch)
    # (a target the bracket's end points do not meet exactly, so the tolerance decides)
    z = cal.calibrate(1.7, DELTA, G, "pld", rel_tol=0.005)
    coarse = cal._bisect(lambda s: 1.0 / s, lambda s: 1.5 / s, 1.7, 0.005 / 4.0)
    assert z == coarse and 1.7 * (1 - 0.005 / 4) <= 1.0 / z <= 1.7
    assert coarse != cal._bisect(lambda s: 1.0 / s, lambda s: 1.5 / s, 1.7, 0.005 / 5.0)
    fine = [c for c in calls if c == ("pld", acc.PLD_DISCRETIZATION)]
    coarse_calls = [c for c in calls if c == ("pld", acc.PLD_COARSE_DISCRETIZATION)]
    assert len(fine) == 2 and coarse_calls  # checked (twice), not searched again


def test_second_stage_moves_down_when_the_fine_grid_is_tighter(monkeypatch):
    calls = _curve(monkeypatch, fine_factor=0.9)
    z = cal.calibrate(2.0, DELTA, G, "pld", rel_tol=0.005)
    eps_fine = 0.9 / z
    assert 2.0 * (1 - 0.005) <= eps_fine <= 2.0
    assert z == pytest.approx(0.45, rel=0.006)
    assert len([c for c in calls if c == ("pld", acc.PLD_DISCRETIZATION)]) < 40


def test_second_stage_moves_up_when_the_fine_grid_is_looser(monkeypatch):
    calls = _curve(monkeypatch, fine_factor=1.1)
    z = cal.calibrate(2.0, DELTA, G, "pld", rel_tol=0.005)
    assert 2.0 * (1 - 0.005) <= 1.1 / z <= 2.0
    assert z == pytest.approx(0.55, rel=0.006)
    # climbs in steps of 1% (10% needs about 10), not by overshooting and coming back
    assert len([c for c in calls if c == ("pld", acc.PLD_DISCRETIZATION)]) < 20


def test_second_stage_limits(monkeypatch):
    _curve(monkeypatch, fine_factor=1e9)  # the fine grid never meets the target
    with pytest.raises(ValueError, match=r"target epsilon 2 is unreachable with a noise multiplier <= 10000"):
        cal.calibrate(2.0, DELTA, G, "pld")
    _curve(monkeypatch, fine_factor=1e-6)  # met even at the smallest multiplier
    assert cal.calibrate(2.0, DELTA, G, "pld") == cal.MIN_NOISE_MULTIPLIER
    _curve(monkeypatch, fine_factor=0.12)  # met just above it (z = 0.06): narrowed
    z = cal.calibrate(2.0, DELTA, G, "pld")
    assert 2.0 * (1 - 0.005) <= 0.12 / z <= 2.0 and z == pytest.approx(0.06, rel=0.006)


def test_a_release_without_noise_costs_infinite_epsilon_with_every_accountant():
    # dp-accounting flags a zero-noise Gaussian as not DP and leaves its PLD empty;
    # read naively, that empty PLD gave epsilon 0.
    for event in (G(0.0), poisson(0.1, 0.0), dpa.LaplaceDpEvent(0.0),
                  dpa.ComposedDpEvent([G(2.0), dpa.SelfComposedDpEvent(G(0.0), 3)])):
        for relation in ("add-remove", "replace-one"):
            assert acc.epsilon(event, DELTA, "pld", relation) == math.inf
    assert acc.epsilon(G(0.0), DELTA, "rdp") == math.inf
    ledger = PrivacyLedger(delta=DELTA, budget=100.0)
    ledger.record("a", G(2.0))
    assert ledger.would_exceed({"a": G(0.0)})
    ledger.record("a", G(0.0))
    assert ledger.epsilon() == math.inf


def test_ledger_details_a_survivor_check_found():
    ledger = PrivacyLedger(delta=DELTA, accountant="rdp", unit="user")
    ledger.record("a", G(3.0))
    both = acc.epsilon(dpa.ComposedDpEvent([G(3.0), G(2.0)]), DELTA, "rdp")
    assert ledger.scope_epsilon("a", G(2.0)) == pytest.approx(both, rel=1e-12)
    assert ledger.scope_epsilon("a") == pytest.approx(acc.epsilon(G(3.0), DELTA, "rdp"), rel=1e-12)
    # an RDP ledger round-trips (its accountant is read back, not defaulted)
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "two" / "levels" / "ledger.json"  # parent folders are created
        ledger.save(path)
        back = PrivacyLedger.load(path)
    assert back.accountant == "rdp" and back.epsilon() == ledger.epsilon()
    # the refusal names the value on disk and this run's
    other = PrivacyLedger(delta=DELTA, accountant="pld", unit="user")
    with pytest.raises(ValueError, match=r"^ledger on disk has accountant='rdp', this run has accountant='pld'$"):
        other.load_state_dict(ledger.state_dict())
    old = {k: v for k, v in ledger.state_dict().items() if k != "neighbouring"}
    ro = PrivacyLedger(delta=DELTA, accountant="rdp", unit="user", neighbouring="replace-one")
    with pytest.raises(ValueError, match=r"^ledger on disk has neighbouring='add-remove', this run has "
                                         r"neighbouring='replace-one'$"):
        ro.load_state_dict(old)


def test_horizontal_details_a_survivor_check_found():
    from flwr_jdp.privacy.horizontal import (
        HorizontalAccountant,
        SiloRelease,
        pareto_maximal,
        subject_inclusion_rate,
    )

    assert subject_inclusion_rate(1.0, 0) == 0.0  # no record: never sampled, whatever the rate
    assert pareto_maximal(np.zeros((0, 2), dtype=np.int64)).dtype == np.int64
    assert HorizontalAccountant(np.array([[1.0, 2.0]]), DELTA).counts.dtype == np.int64
    with pytest.raises(ValueError, match=r"^counts must be a \(subjects, silos\) array of non-negative ints$"):
        HorizontalAccountant(np.array([[1, -1]]), DELTA)
    counts = np.array([[1, 0, 0], [2, 1, 0], [1, 0, 0], [0, 0, 3]])
    rel = [SiloRelease(1.0, 3.0, 2), SiloRelease(1.0, 3.0, 2), SiloRelease(0.5, 1.0, 2)]
    for accountant in ("rdp", "pld"):
        a = HorizontalAccountant(counts, DELTA, accountant)
        subject, eps = a.worst_subject(rel, 1)  # the second candidate is the worst
        assert subject == 3
        assert eps == pytest.approx(acc.epsilon(rel[2].subject_event(3, 1), DELTA, accountant), rel=1e-9)
    # a target reached below z = 1: exact calibration does not start from 1
    a = HorizontalAccountant(counts, DELTA, "rdp")

    def releases_of(z):
        return [SiloRelease(1.0, z, 1) for _ in range(3)]

    z = a.calibrate(20.0, 1, releases_of)
    assert z < 1.0 and 20.0 * 0.99 <= a.epsilon(releases_of(z), 1) <= 20.0


# ------------------------------------------------- search and screening logic, on fakes
class _Capped:
    """An epsilon curve that fails after ``cap`` evaluations (a search that does not
    end is a failure, not a hang)."""

    def __init__(self, fn, cap: int = 2000):
        self.fn, self.cap, self.calls = fn, cap, 0

    def __call__(self, z):  # noqa: ANN001
        self.calls += 1
        if self.calls > self.cap:
            raise RuntimeError("the search does not end")
        return self.fn(z)


def test_bisection_climbs_when_the_accountant_exceeds_its_rdp_bracket():
    eps = _Capped(lambda z: 2.0 / z)  # twice the (cheap) bracketing curve
    z = cal._bisect(eps, _Capped(lambda z: 1.0 / z), 1.0, 0.001)
    assert 1.0 * (1 - 0.001) <= eps(z) <= 1.0 and z == pytest.approx(2.0, rel=0.002)


def test_calibration_reraises_an_accountant_error_unless_rdp_cannot_do_replace_one(monkeypatch):
    def fake(event, delta, backend="pld", relation="add-remove", discretization=acc.PLD_DISCRETIZATION):
        if backend == "rdp":
            raise ValueError("no RDP for this event")
        return 1.0 / event.noise_multiplier

    monkeypatch.setattr(cal, "epsilon", fake)
    with pytest.raises(ValueError, match="no RDP for this event"):
        cal.calibrate(2.0, DELTA, G, "rdp")
    with pytest.raises(ValueError, match="no RDP for this event"):
        cal.calibrate(2.0, DELTA, G, "pld")  # RDP brackets the search under add/remove
    z = cal.calibrate(2.0, DELTA, G, "pld", relation="replace-one")  # ranked by PLD instead
    assert 2.0 * (1 - 0.005) <= 1.0 / z <= 2.0


def _screen(monkeypatch, table):
    """``screened_max_epsilon`` over fake events: event j has ledger-grid epsilon
    ``table[j][0]``, coarse-grid ``table[j][1]`` and RDP ``table[j][2]``; returns the
    (backend, grid, j) of every evaluation."""
    calls = []

    def fake(j, delta, accountant="pld", relation="add-remove", discretization=acc.PLD_DISCRETIZATION):
        calls.append((accountant, discretization, j))
        if accountant == "rdp":
            return table[j][2]
        return table[j][0] if discretization == acc.PLD_DISCRETIZATION else table[j][1]

    monkeypatch.setattr(acc, "epsilon", fake)
    return calls


def test_screening_settles_only_the_events_that_can_be_the_maximum(monkeypatch):
    # one event dominates by every bound: it alone is computed on the ledger grid
    calls = _screen(monkeypatch, [(1.0, 1.05, 1.3), (5.0, 5.2, 6.0), (2.0, 2.1, 2.5)])
    assert acc.screened_max_epsilon(list(range(3)), DELTA) == (5.0, 1, {1: 5.0})
    assert sorted(c for c in calls if c[0] == "rdp") == [("rdp", acc.PLD_DISCRETIZATION, j) for j in range(3)]
    assert [c for c in calls if c[0] == "pld"] == [("pld", acc.PLD_DISCRETIZATION, 1)]
    # the largest RDP bound is not the maximum; the coarse grid ranks the rest
    table = [(3.0, 3.1, 10.0), (4.0, 4.1, 9.0), (3.5, 3.6, 8.0), (1.0, 1.1, 2.0), (2.0, 4.5, 5.0)]
    calls = _screen(monkeypatch, table)
    assert acc.screened_max_epsilon(list(range(5)), DELTA) == (4.0, 1, {0: 3.0, 4: 2.0, 1: 4.0})
    pld = [c for c in calls if c[0] == "pld"]
    coarse = sorted(j for (_, grid, j) in pld if grid == acc.PLD_COARSE_DISCRETIZATION)
    fine = [j for (_, grid, j) in pld if grid == acc.PLD_DISCRETIZATION]
    assert coarse == [1, 2, 4] and fine == [0, 4, 1]  # event 3's RDP bound is below 3.0


def test_opacus_bound_reads_a_diverged_order_as_infinite(monkeypatch):
    import logging

    from opacus.accountants.analysis import rdp as opacus_rdp

    seen = {}

    def fake(q, noise_multiplier, steps, orders):
        seen.update(q=q, z=noise_multiplier, steps=steps, orders=orders)
        return [0.5, float("nan"), 2.0]

    monkeypatch.setattr(opacus_rdp, "compute_rdp", fake)
    root = logging.getLogger()
    level = root.level
    out = rdp._opacus_rdp(0.1, 1.5, np.array([2.0, 3.0, 4.0]))
    assert seen == {"q": 0.1, "z": 1.5, "steps": 1, "orders": [2.0, 3.0, 4.0]}
    assert out.dtype == np.float64 and out[0] == 0.5 and out[1] == np.inf and out[2] == 2.0
    assert root.level == level


def test_bisection_never_returns_the_floor_when_the_target_needs_more_noise():
    # the halving reaches lo <= MIN_NOISE_MULTIPLIER, but z = 0.05 misses the target
    eps = _Capped(lambda z: 1.0 / z)
    z = cal._bisect(eps, eps, 1.0 / 0.06, 0.001)
    assert z > cal.MIN_NOISE_MULTIPLIER and 1.0 / z <= 1.0 / 0.06
    assert z == pytest.approx(0.06, rel=0.002)


def test_narrowing_stops_as_soon_as_the_bracket_is_narrow_enough():
    eps = _Capped(lambda z: 10.00000006 / z)  # the target 2 is met from z = 5.00000003 up
    hi = cal._narrow(eps, 4.9999999, 5.0000001, 2.0, 0.0)  # width 1e-7 < 1e-7 * 5 after one halving
    assert eps.calls == 2 and hi == 5.0000001


def test_second_stage_never_returns_the_floor_when_the_target_needs_more_noise(monkeypatch):
    # The fine grid needs z just above MIN_NOISE_MULTIPLIER: the 1% descent from the coarse
    # answer 0.5 passes 0.0500529 (target met) and stops at 0.0495524, below the floor,
    # where the floor itself (0.05) misses the target.
    for factor in (0.10002, 0.10004, 0.10008):
        _curve(monkeypatch, fine_factor=factor)
        z = cal.calibrate(2.0, DELTA, G, "pld")
        assert z >= cal.MIN_NOISE_MULTIPLIER and factor / z <= 2.0, factor


def test_large_targets_calibrate_on_the_coarser_grids_the_ledger_bound_allows(monkeypatch):
    grids = []

    def fake(event, delta, backend="pld", relation="add-remove", discretization=acc.PLD_DISCRETIZATION):
        if backend == "rdp":
            raise ValueError("RDP of Poisson-sampled releases under replace-one is not supported")
        grids.append(discretization)
        return 10.0 / event.noise_multiplier

    monkeypatch.setattr(cal, "epsilon", fake)
    z = cal.calibrate(20.0, DELTA, G, "pld", relation="replace-one")
    assert 20.0 * (1 - 0.005) <= 10.0 / z <= 20.0
    assert cal.pld_grid(20.0) == pytest.approx(20 * acc.PLD_DISCRETIZATION)
    assert {round(g / acc.PLD_DISCRETIZATION, 6) for g in grids} == {20.0, 200.0}  # never the ledger's 1e-4


def test_rdp_silences_dp_accountings_warnings_on_diverging_orders(caplog):
    import logging

    rdp._base_rdp.cache_clear()
    absl_level = logging.getLogger("absl").level
    with caplog.at_level(logging.WARNING):
        rdp.rdp_vector(poisson(0.3, 0.8))  # its series fails to converge at orders 1.5-1.7
        rdp.rdp_vector(poisson(0.3, 0.8), [1.5, 2.0])
    assert not [r for r in caplog.records if r.name == "absl"]
    assert logging.getLogger("absl").level == absl_level  # restored after each call
