"""Decoupled personal parameters: an owner's shared release does not depend on its
personal state, so DP-SGD's per-unit sensitivity argument holds (record/user units)."""

import copy

import numpy as np
import pytest
import torch

from flwr_jdp.joint_dp.config import ConfigError, parse_config
from flwr_jdp.joint_dp.owner_round import OwnerPlan, fit_personal, train_owner_round
from flwr_jdp.joint_dp.owner_state import new_model, owner_data, public_personal, shared_digest
from flwr_jdp.params import get_arrays
from flwr_jdp.privacy.mechanisms import torch_generator

from .helpers import run_inprocess


def _cfg(run_config, **extra):
    run_config.update({"method": "joint-dp", **extra})
    return parse_config(run_config)


def _scrambled(model, split, seed):
    """A copy of ``model`` whose personal parameters hold arbitrary other values
    (standing in for personal state trained on the owner's data)."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    params = dict(out.named_parameters())
    with torch.no_grad():
        for n in split.personal:
            params[n].add_(torch.randn(params[n].shape, generator=gen))
    return out


def _release(cfg, model, split, data, public):
    plan = OwnerPlan(sample_rate=0.5, steps=3, noise_multiplier=1.0)
    rel, _ = train_owner_round(model, split, data, cfg, plan, torch_generator(11), public)
    return rel


@pytest.mark.parametrize("release", ["seeded", "zero-head"])
@pytest.mark.parametrize("placement", ["local", "central"])
@pytest.mark.parametrize("unit", ["record", "user"])
def test_decoupled_release_ignores_personal_state(run_config, placement, unit, release):
    cfg = _cfg(run_config, **{"noise-placement": placement, "privacy-unit": unit,
                              "records-per-user": 3, "release-personal": release})
    assert cfg.decoupled
    data = owner_data(cfg)[1]
    model, split = new_model(cfg, data)
    public = public_personal(cfg, data)
    a, b = _scrambled(model, split, 1), _scrambled(model, split, 2)
    before = get_arrays(b, split.personal)
    rel_a = _release(cfg, a, split, data, public)
    rel_b = _release(cfg, b, split, data, public)
    assert set(rel_a) == set(split.shared)
    for n in split.shared:
        np.testing.assert_array_equal(rel_a[n], rel_b[n])
    # the owner's own model is left as it came (personal state is fitted separately)
    for n, v in get_arrays(b, split.personal).items():
        np.testing.assert_array_equal(v, before[n])


def test_interleaved_release_depends_on_personal_state(run_config):
    """The paper's Algorithm 1: the release changes with the personal state, which is
    why its record-level guarantee is not established."""
    cfg = _cfg(run_config, **{"personal-coupling": "interleaved"})
    assert not cfg.decoupled
    data = owner_data(cfg)[1]
    model, split = new_model(cfg, data)
    rel_a = _release(cfg, _scrambled(model, split, 1), split, data, None)
    rel_b = _release(cfg, _scrambled(model, split, 2), split, data, None)
    assert any(not np.array_equal(rel_a[n], rel_b[n]) for n in split.shared)


def test_decoupled_needs_public_values(run_config):
    cfg = _cfg(run_config)
    data = owner_data(cfg)[0]
    model, split = new_model(cfg, data)
    with pytest.raises(ValueError, match="public"):
        _release(cfg, model, split, data, None)


def test_owner_unit_is_not_decoupled(run_config):
    assert not _cfg(run_config, **{"privacy-unit": "owner"}).decoupled
    assert not _cfg(run_config, method="full-dp").decoupled


def test_fit_personal_trains_only_personal(run_config):
    cfg = _cfg(run_config, **{"local-epochs": 2})
    data = owner_data(cfg)[0]
    model, split = new_model(cfg, data)
    shared0 = get_arrays(model, split.shared)
    personal0 = get_arrays(model, split.personal)
    fit_personal(model, split, data, cfg, torch_generator(3))
    for n, v in get_arrays(model, split.shared).items():
        np.testing.assert_array_equal(v, shared0[n])
    assert any(not np.allclose(v, personal0[n]) for n, v in get_arrays(model, split.personal).items())


def test_bad_coupling_names_the_key(run_config):
    run_config["personal-coupling"] = "tight"
    with pytest.raises(ConfigError, match="personal-coupling"):
        parse_config(run_config)


@pytest.mark.parametrize("placement", ["local", "central"])
def test_owners_end_fitted_on_the_final_broadcast(run_config, placement):
    """After a run, every owner's personal parameters were fitted (not the public
    init) against the final global shared parameters, the model it is evaluated with."""
    run_config.update({"noise-placement": placement, "num-rounds": 2})
    strategy, grid, result = run_inprocess(run_config, num_nodes=2)
    digest = shared_digest(result.arrays)
    cfg = parse_config(run_config)
    data = owner_data(cfg)
    fitted = 0
    for ctx in grid.contexts.values():
        for key in list(ctx.state.keys()):
            if key.startswith("personal.") and key.endswith(".meta"):
                assert ctx.state[key]["fit-on"] == digest
                assert int(ctx.state[key]["trained-rounds"]) == 2
                owner = int(key.split(".")[1])
                arrays = ctx.state[f"personal.{owner}"].to_numpy_ndarrays()
                public = public_personal(cfg, data[owner])
                assert any(not np.allclose(a, p) for a, p in zip(arrays, public.values(), strict=False))
                fitted += 1
    assert fitted == cfg.num_owners


def test_zero_head_release_values(run_config):
    """``release-personal = zero-head``: personal head parameters are public zeros,
    personal parameters outside the head keep their seeded values."""
    cfg = _cfg(run_config, **{"personal-layers": r"^(conv1|fc1)\.", "release-personal": "zero-head"})
    seeded = _cfg(run_config, **{"release-personal": "seeded"})
    data = owner_data(cfg)[0]
    zero, init = public_personal(cfg, data), public_personal(seeded, data)
    assert set(zero) == {"conv1.weight", "conv1.bias", "fc1.weight", "fc1.bias"} == set(init)
    for n in ("fc1.weight", "fc1.bias"):
        assert not np.any(zero[n]) and np.any(init[n])
    for n in ("conv1.weight", "conv1.bias"):
        np.testing.assert_array_equal(zero[n], init[n])


def test_zero_head_release_is_dp_sgd_on_a_zero_head_model(run_config):
    """The zero-head release equals the seeded release computed on a model whose
    seeded FC1 was replaced by zeros: only the public constant differs, so the
    release is the same DP-SGD mechanism (and ledger event) on the shared layers;
    and it differs from the seeded release (the key does act)."""
    cfg = _cfg(run_config, **{"release-personal": "zero-head"})
    seeded = _cfg(run_config, **{"release-personal": "seeded"})
    data = owner_data(cfg)[1]
    model, split = new_model(cfg, data)
    zero_public = public_personal(cfg, data)
    rel_zero = _release(cfg, copy.deepcopy(model), split, data, zero_public)
    rel_same = _release(seeded, copy.deepcopy(model), split, data, zero_public)
    rel_seeded = _release(seeded, copy.deepcopy(model), split, data, public_personal(seeded, data))
    for n in split.shared:
        np.testing.assert_array_equal(rel_zero[n], rel_same[n])
    assert any(not np.array_equal(rel_zero[n], rel_seeded[n]) for n in split.shared)


@pytest.mark.parametrize("extra", [{"method": "full-dp"}, {"personal-coupling": "interleaved"},
                                   {"privacy-unit": "owner"}, {"bogus": 1, "release-personal": "zeros"}])
def test_release_personal_outside_a_decoupled_release_names_the_key(run_config, extra):
    run_config.update({"method": "joint-dp", "release-personal": "zero-head", **extra})
    with pytest.raises(ConfigError, match="release-personal"):
        parse_config(run_config)


def test_zero_head_reaches_the_clientapp_and_keeps_the_ledger(run_config, tmp_path):
    """Through the real ServerApp strategy and ClientApp: with the same noise seed, the
    zero-head run releases other shared parameters than the seeded one (the nodes read
    the key from the run config) and records exactly the same ledger events."""
    runs = {}
    for release in ("seeded", "zero-head"):
        cfg = dict(run_config, method="joint-dp", **{"release-personal": release,
                                                     "results-dir": str(tmp_path / release)})
        strategy, _, result = run_inprocess(cfg, num_nodes=2)
        runs[release] = (strategy, {k: v.numpy() for k, v in result.arrays.items()})
    (seeded, a), (zero, b) = runs["seeded"], runs["zero-head"]
    assert set(a) == set(b) and any(not np.array_equal(a[k], b[k]) for k in a)
    assert seeded.noise_multiplier == zero.noise_multiplier
    assert seeded.ledger.scopes == zero.ledger.scopes and seeded.ledger.scopes
    assert seeded.ledger.epsilon() == zero.ledger.epsilon()
