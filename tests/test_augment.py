"""Random translation of the owners' own training images (run-config
``augment-shift``): what it does to a batch, where it applies, and that no DP
release depends on it."""

import copy

import numpy as np
import pytest
import torch

from flwr_jdp.joint_dp import owner_round as owner_round_module
from flwr_jdp.joint_dp.config import ConfigError, parse_config
from flwr_jdp.joint_dp.owner_round import OwnerPlan, fit_personal, train_owner_round
from flwr_jdp.joint_dp.owner_state import new_model, owner_data, public_personal
from flwr_jdp.params import get_arrays
from flwr_jdp.training import train_plain
from flwr_jdp.training.augment import random_shift
from research.reproduce_joint_dp import Cell, comparable, run_config


def test_shift_zero_is_the_identity_and_draws_nothing():
    x = torch.randn(5, 1, 8, 8)
    gen = torch.Generator().manual_seed(3)
    state = gen.get_state()
    assert random_shift(x, 0, gen) is x
    assert torch.equal(gen.get_state(), state)


@pytest.mark.parametrize("shift", [1, 2, 3])
def test_every_image_is_a_translated_crop_of_its_padded_self(shift):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 2, 9, 7, generator=gen)
    out = random_shift(x, shift, torch.Generator().manual_seed(1))
    assert out.shape == x.shape
    padded = torch.nn.functional.pad(x, (shift,) * 4, mode="replicate")
    offsets = set()
    for i in range(len(x)):
        hits = [(dy, dx) for dy in range(2 * shift + 1) for dx in range(2 * shift + 1)
                if torch.equal(out[i], padded[i, :, dy:dy + 9, dx:dx + 7])]
        assert hits, f"image {i} is not a translation of itself within {shift} pixels"
        offsets.update(hits)
    assert len(offsets) > 3  # the offsets vary over images


def test_shift_needs_images():
    with pytest.raises(ValueError, match="image records"):
        random_shift(torch.randn(4, 10), 2, torch.Generator())


@pytest.mark.parametrize("value", [-1, 9])
def test_bad_shift_fails_at_start_up_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"'augment-shift' must be in \[0, 8\]"):
        parse_config({"augment-shift": value})


def test_runs_stored_before_the_key_existed_compare_equal():
    assert comparable({"seed": 0, "augment-shift": 0}) == {"seed": 0}
    assert comparable({"seed": 0, "augment-shift": 2}) == {"seed": 0, "augment-shift": 2}


def test_cell_names_and_configures_the_shift(tmp_path):
    cell = Cell("fashion-mnist", 256, "joint-dp", personal="conv1+conv2+fc1", augment=2)
    assert cell.name.endswith("-aug2")
    assert run_config(cell, 0, "", str(tmp_path))["augment-shift"] == 2
    assert "augment-shift" not in run_config(Cell("fashion-mnist", 256, "per-silo"), 0, "", str(tmp_path))
    with pytest.raises(ValueError, match="--augment-shift"):
        Cell("fashion-mnist", 256, "per-silo", augment=9)


def test_train_plain_augments_only_when_asked(run_config):
    cfg = parse_config({**run_config, "method": "per-silo"})
    data = owner_data(cfg)[0]
    base, _ = new_model(cfg, data)
    trained = {}
    for shift in (0, 0, 1):
        model = copy.deepcopy(base)
        train_plain(model, list(model.parameters()), data.x_train, data.y_train, epochs=1,
                    batch_size=16, lr=0.1, generator=torch.Generator().manual_seed(2),
                    augment_shift=shift)
        trained.setdefault(shift, []).append(model)
    same = zip(trained[0][0].parameters(), trained[0][1].parameters(), strict=True)
    assert all(torch.equal(p, q) for p, q in same)
    moved = zip(trained[0][0].parameters(), trained[1][0].parameters(), strict=True)
    assert any(not torch.equal(p, q) for p, q in moved)


def test_fit_personal_augments_the_head_through_the_trunk(run_config, monkeypatch):
    """With a shift the cached-feature fast path (one trunk pass per fit) cannot
    hold, so the head is trained through the trunk on translated images."""
    cfg = parse_config({**run_config, "method": "joint-dp", "augment-shift": 2})
    data = owner_data(cfg)[0]
    model, split = new_model(cfg, data)

    def no_cache(*args, **kwargs):
        raise AssertionError("features cached although the images are augmented")

    monkeypatch.setattr(owner_round_module, "trunk_features", no_cache)
    before = get_arrays(model, split.personal)
    fit_personal(model, split, data, cfg, torch.Generator().manual_seed(0))
    after = get_arrays(model, split.personal)
    assert any(not np.array_equal(before[n], after[n]) for n in split.personal)


@pytest.mark.parametrize("placement", ["local", "central"])
def test_dp_release_does_not_depend_on_the_shift(run_config, placement):
    """The shared release (DP-SGD under local noise, a clipped gradient sum under
    central noise) is computed on unaugmented records: its sensitivity and its
    ledger event are those of a run without the key."""
    releases = []
    for shift in (0, 3):
        cfg = parse_config({**run_config, "method": "joint-dp", "noise-placement": placement,
                            "augment-shift": shift})
        data = owner_data(cfg)[1]
        model, split = new_model(cfg, data)
        out, _ = train_owner_round(model, split, data, cfg, OwnerPlan(0.5, 3, 1.0),
                                   torch.Generator().manual_seed(9), public_personal(cfg, data))
        releases.append(out)
    for name in releases[0]:
        np.testing.assert_array_equal(releases[0][name], releases[1][name])
