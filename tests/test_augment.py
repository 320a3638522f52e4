"""Random translation of the owners' own training images (run-config
``augment-shift``): what it does to a batch, where it applies (the own app's
``train`` on the owner's own loader: the personal fit), and that no DP release
depends on it."""

import copy

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

from apps.joint_dp.joint_dp import client_app
from apps.joint_dp.joint_dp.server_app import initial_arrays
from apps.joint_dp.joint_dp.task import initial_model, loader, node_job_config, owner_data, train
from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import ConfigError, parse_config
from flwr_jdp.joint_dp.owner_store import load_personal_arrays
from flwr_jdp.joint_dp.schedule import OwnerSize, build_schedule
from flwr_jdp.params import split_parameters
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


def test_train_augments_only_when_asked(run_config):
    """The own app's ``train`` (and ``train_plain``, the FedAvg baseline's): the same
    seeded batches give the same model without a shift, another one with it."""
    cfg = parse_config({**run_config, "method": "per-silo"})
    data = owner_data(cfg)[0]
    base = initial_model(cfg)
    trained = {}
    for shift in (0, 0, 1):
        model, twin = copy.deepcopy(base), copy.deepcopy(base)
        train(model, loader(cfg, data, torch.Generator().manual_seed(2)), epochs=1, lr=0.1,
              augment_shift=shift, generator=torch.Generator().manual_seed(3))
        train_plain(twin, list(twin.parameters()), data.x_train, data.y_train, epochs=1,
                    batch_size=16, lr=0.1, generator=torch.Generator().manual_seed(2),
                    augment_shift=shift)
        trained.setdefault(shift, []).append((model, twin))
    for i in (0, 1):
        same = zip(trained[0][0][i].parameters(), trained[0][1][i].parameters(), strict=True)
        assert all(torch.equal(p, q) for p, q in same)
        moved = zip(trained[0][0][i].parameters(), trained[1][0][i].parameters(), strict=True)
        assert any(not torch.equal(p, q) for p, q in moved)


def _round(run_config, owner=1):
    """One train round of ``owner`` through the own app's handler on a fresh node
    (set-up first, as the server does); returns (release, saved personal state)."""
    ctx = Context(run_id=1, node_id=1000 + owner, node_config={"partition-id": owner, "num-partitions": 4},
                  state=RecordDict(), run_config=dict(run_config))
    cfg = node_job_config(ctx)
    rec = initial_arrays(cfg)
    split = split_parameters(initial_model(cfg), cfg.effective_personal_rule)
    InProcessGrid(client_app.app, 1, ctx.run_config)  # stamps message identities
    query = Message(RecordDict({protocol.CONFIG: ConfigRecord(), protocol.PUBLIC_PERSONAL: protocol.to_record(
        {n: rec[n].numpy() for n in split.personal})}), dst_node_id=ctx.node_id, message_type=MessageType.QUERY)
    setup = client_app.app(query, ctx)
    assert setup.has_content(), setup.error.reason
    size = setup.content[protocol.SETUP]
    schedule = build_schedule(cfg, {owner: OwnerSize(size[protocol.NUM_RECORDS][0], size[protocol.NUM_USERS][0])})
    instruction = ConfigRecord({
        protocol.ROUND: 1, protocol.OWNERS: [owner], protocol.SAMPLE_RATES: [schedule.owner_rates[owner]],
        protocol.STEPS: [min(3, schedule.owner_steps[owner])], protocol.NOISE_MULTIPLIER: 1.0,
        protocol.SESSION: "s1"})
    msg = Message(RecordDict({protocol.SHARED: protocol.to_record({n: rec[n].numpy() for n in split.shared}),
                              protocol.CONFIG: instruction}), dst_node_id=ctx.node_id, message_type=MessageType.TRAIN)
    reply = client_app.app(msg, ctx)
    assert reply.has_content(), reply.error.reason
    release = {k: reply.content["arrays"][k].numpy() for k in reply.content["arrays"].keys()}
    return release, load_personal_arrays(ctx, owner, "s1")


@pytest.mark.parametrize("placement", ["local", "central"])
def test_the_personal_fit_is_augmented_and_the_dp_release_is_not(run_config, placement):
    """Through the own ClientApp's train handler with the same noise seed: the shared
    release (DP-SGD under local noise, a clipped gradient sum under central noise) is
    computed on unaugmented Poisson batches, bit for bit that of a run without the
    key (so its sensitivity and ledger event are too); the personal layers, fitted on
    the owner's own batches, are fitted on translated images."""
    rounds = {}
    for shift in (0, 0, 3):
        rc = dict(run_config, **{"method": "joint-dp", "noise-placement": placement, "augment-shift": shift})
        rounds.setdefault(shift, []).append(_round(rc))
    (plain, personal), (again, personal_again) = rounds[0]
    shifted, personal_shifted = rounds[3][0]
    assert list(plain) == list(shifted) and plain
    for name in plain:
        np.testing.assert_array_equal(plain[name], shifted[name])
        np.testing.assert_array_equal(plain[name], again[name])
    for name in personal:  # a seeded round is reproducible ...
        np.testing.assert_array_equal(personal[name], personal_again[name])
    assert any(not np.array_equal(personal[n], personal_shifted[n]) for n in personal)  # ... the shift acts
