"""The ledger and accountants against public reference values."""

import math

import dp_accounting as dpa
import pytest
from scipy.stats import norm

from flwr_jdp.privacy import events as ev
from flwr_jdp.privacy.accountants import epsilon, screened_max_epsilon
from flwr_jdp.privacy.calibration import calibrate
from flwr_jdp.privacy.ledger import PrivacyLedger, owner_scope


def exact_gaussian_epsilon(z: float, delta: float) -> float:
    """Analytic Gaussian mechanism (Balle & Wang 2018): smallest eps for delta."""
    def d(eps):
        return norm.cdf(-eps * z + 1 / (2 * z)) - math.exp(eps) * norm.cdf(-eps * z - 1 / (2 * z))
    lo, hi = 0.0, 50.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if d(mid) > delta else (lo, mid)
    return hi


def test_rdp_matches_opacus_reference():
    # Opacus accountants_test: z=1.5, q=0.04, 2250 steps, delta=1e-5 -> 7.32911117143
    eps = epsilon(ev.dp_sgd(1.5, 0.04, 2250), 1e-5, "rdp")
    assert eps == pytest.approx(7.32911117143, abs=1e-6)


def test_pld_is_tighter_than_rdp_on_dp_sgd():
    event = ev.dp_sgd(1.5, 0.04, 2250)
    assert epsilon(event, 1e-5, "pld") < epsilon(event, 1e-5, "rdp")


def test_single_gaussian_exact_value():
    exact = exact_gaussian_epsilon(1.0, 1e-5)
    assert exact == pytest.approx(4.37718, abs=1e-5)
    assert epsilon(ev.gaussian(1.0), 1e-5, "pld") == pytest.approx(exact, abs=1e-3)
    assert epsilon(ev.gaussian(1.0), 1e-5, "pld") >= exact - 1e-9  # an upper bound
    assert epsilon(ev.gaussian(1.0), 1e-5, "rdp") >= exact


def test_flattened_composition_equals_dp_accounting():
    from dp_accounting.pld import PLDAccountant

    event = dpa.ComposedDpEvent([ev.dp_sgd(1.1, 0.1, 30), ev.dp_sgd(1.1, 0.1, 30), ev.gaussian(3.0)])
    acc = PLDAccountant()
    acc.compose(event)
    assert epsilon(event, 1e-5, "pld") == pytest.approx(acc.get_epsilon(1e-5), rel=1e-6)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_calibration_within_one_percent(accountant):
    target = 2.0
    z = calibrate(target, 1e-5, lambda s: ev.dp_sgd(s, 0.04, 500), accountant)
    reached = epsilon(ev.dp_sgd(z, 0.04, 500), 1e-5, accountant)
    assert reached <= target
    assert reached >= 0.99 * target


def test_ledger_max_over_owners_and_round_trip(tmp_path):
    ledger = PrivacyLedger(delta=1e-5, budget=10.0)
    for _ in range(3):
        ledger.record_round(1, {owner_scope(0): ev.dp_sgd(1.0, 0.1, 10),
                                owner_scope(1): ev.dp_sgd(1.0, 0.2, 5)})
    e0 = ledger.scope_epsilon(owner_scope(0))
    e1 = ledger.scope_epsilon(owner_scope(1))
    assert ledger.epsilon() == pytest.approx(max(e0, e1))
    assert e0 == pytest.approx(epsilon(ev.dp_sgd(1.0, 0.1, 30), 1e-5), rel=1e-9)
    path = tmp_path / "ledger.json"
    ledger.save(path)
    again = PrivacyLedger.load(path)
    assert again.epsilon() == pytest.approx(ledger.epsilon())
    assert again.scopes == ledger.scopes


def test_would_exceed_and_mismatched_restore(tmp_path):
    ledger = PrivacyLedger(delta=1e-5, budget=1.0)
    assert ledger.would_exceed({"server": ev.gaussian(1.0)})  # 4.38 > 1
    assert not ledger.would_exceed({"server": ev.gaussian(20.0)})
    ledger.save(tmp_path / "l.json")
    other = PrivacyLedger(delta=1e-6)
    with pytest.raises(ValueError, match="delta"):
        other.load_state_dict(PrivacyLedger.load(tmp_path / "l.json").state_dict())


def test_event_json_round_trip():
    event = dpa.ComposedDpEvent([ev.dp_sgd(1.0, 0.3, 4), ev.gaussian(2.0)])
    assert ev.from_dict(ev.to_dict(event)) == event


def _named_tuple_dict(value):
    """dp-accounting's own serialisation (``to_named_tuple``) as a dict, without
    ``module_name``: the format ledgers have always been written in."""
    if hasattr(value, "_fields") and "class_name" in value._fields:
        return {f: _named_tuple_dict(getattr(value, f)) for f in value._fields if f != "module_name"}
    if isinstance(value, (list, tuple)):
        return [_named_tuple_dict(v) for v in value]
    return value


@pytest.mark.parametrize("event", [
    ev.gaussian(1.3),
    ev.dp_sgd(0.9, 0.01, 7),
    dpa.LaplaceDpEvent(0.5),
    dpa.NoOpDpEvent(),
    dpa.ComposedDpEvent([ev.dp_sgd(1.0, 0.3, 4), dpa.SelfComposedDpEvent(
        dpa.ComposedDpEvent([ev.gaussian(2.0), dpa.PoissonSampledDpEvent(0.2, dpa.LaplaceDpEvent(1.0))]), 3)]),
    dpa.SampledWithoutReplacementDpEvent(100, 10, ev.gaussian(1.0)),
])
def test_event_codec_writes_dp_accountings_named_tuple_format(event):
    """The codec builds the dict from the attrs fields directly; it must equal
    dp-accounting's ``to_named_tuple`` form, so ledgers saved before still merge."""
    assert ev.to_dict(event) == _named_tuple_dict(event.to_named_tuple())
    assert ev.from_dict(ev.to_dict(event)) == event


def test_screened_epsilon_equals_max_over_all_scopes():
    """With many distinct scopes the ledger skips scopes by their RDP bound; the
    result must still be the maximum of every scope's own PLD epsilon."""
    ledger = PrivacyLedger(delta=1e-5, accountant="pld", unit="subject")
    for r in range(1, 4):
        ledger.record_round(r, {
            f"subject/{i}": dpa.SelfComposedDpEvent(
                dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), steps)
            for i, (q, z, steps) in enumerate([(0.01, 1.0, 5), (0.02, 1.2, 5), (0.05, 3.0, 2),
                                               (0.01, 0.8, 3), (0.1, 8.0, 1), (0.03, 1.5, 4)])})
    brute = max(ledger.scope_epsilon(s) for s in ledger.scopes)
    fresh = PrivacyLedger(delta=1e-5, accountant="pld", unit="subject")
    fresh.scopes = ledger.scopes
    assert fresh.epsilon() == brute


def test_screened_max_settles_few_events_and_finds_the_maximum():
    """Per-subject events as in subject sampling: each subject composes the releases
    of the silos that hold it (incomparable silo sets). The screened maximum must
    equal the brute-force maximum and its argmax, with far fewer ledger-grid PLDs."""
    import numpy as np

    rates = [0.05 + 0.03 * i for i in range(8)]
    rng = np.random.default_rng(0)
    sets = {tuple(sorted(rng.choice(8, size=4, replace=False))) for _ in range(40)}
    events = [ev.compose([ev.dp_sgd(3.0, rates[i], 40) for i in s]) for s in sorted(sets)]
    brute = [epsilon(e, 1e-5, "pld") for e in events]
    value, arg, exact = screened_max_epsilon(events, 1e-5)
    assert value == max(brute) and brute[arg] == value
    assert exact[arg] == value and len(exact) < len(events) / 4
    # a floor at or above every event's epsilon settles nothing and returns the floor
    assert screened_max_epsilon(events, 1e-5, floor=max(brute) + 1.0) == (max(brute) + 1.0, -1, {})


def test_pld_calibration_is_settled_on_the_ledger_grid():
    """Calibration searches on a coarse PLD grid but decides on the ledger's own
    grid: several owners' events, many steps (where the grids differ most)."""
    from flwr_jdp.privacy.accountants import PLD_COARSE_DISCRETIZATION

    target = 4.0

    def events(z):
        return [ev.dp_sgd(z, 0.0032, 3125), ev.dp_sgd(z, 0.01, 1000)]

    z = calibrate(target, 1e-5, events, "pld")
    reached = max(epsilon(e, 1e-5, "pld") for e in events(z))
    assert (1 - 0.005) * target <= reached <= target
    coarse = max(epsilon(e, 1e-5, "pld", discretization=PLD_COARSE_DISCRETIZATION) for e in events(z))
    assert coarse >= reached  # the coarse grid is the looser upper bound
