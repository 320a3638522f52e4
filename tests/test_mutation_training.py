"""Unit checks of the DP trainers (flwr_jdp/training/dp_sgd.py, user_loop.py)
written to kill surviving mutants (docs/mutation.md): Poisson sampling of units,
the unit index, batch sums, and the released step."""

import numpy as np
import torch

from flwr_jdp.training import dp_sgd as d


def test_unit_index():
    idx, n = d._unit_index(4, None)
    assert torch.equal(idx, torch.arange(4)) and n == 4
    idx, n = d._unit_index(3, np.array([2, 0, 2]))
    assert idx.tolist() == [2, 0, 2] and idx.dtype == torch.int64 and n == 3
    idx, n = d._unit_index(0, np.array([], dtype=np.int64))
    assert n == 0 and len(idx) == 0


def test_batch_of_maps_records_to_units_in_the_batch():
    unit_of_record = torch.tensor([0, 1, 1, 2, 3, 3])
    batch = d._batch_of(unit_of_record, torch.tensor([False, True, False, True]))
    assert batch.records.tolist() == [1, 2, 4, 5]
    assert batch.units.tolist() == [0, 0, 1, 1] and batch.num_units == 2


def test_poisson_sample_rate_and_edges():
    gen = torch.Generator().manual_seed(0)
    unit_of_record = torch.arange(20_000)
    batch = d.poisson_sample(unit_of_record, 20_000, 0.25, gen)
    assert abs(batch.num_units - 5000) < 6 * np.sqrt(20_000 * 0.25 * 0.75)
    assert d.poisson_sample(unit_of_record, 20_000, 0.0, gen).num_units == 0
    assert d.poisson_sample(unit_of_record, 20_000, 1.0, gen).num_units == 20_000
    secure = d.secure_poisson_sample(unit_of_record, 20_000, 0.25)
    assert abs(secure.num_units - 5000) < 6 * np.sqrt(20_000 * 0.25 * 0.75)
    assert d.secure_poisson_sample(unit_of_record, 20_000, 1.0).num_units == 20_000
    assert d.secure_poisson_sample(unit_of_record, 20_000, 0.0).num_units == 0


# ------------------------------------------------------------------- user_loop
import logging  # noqa: E402

import pytest  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from flwr_jdp.training import user_loop as ul  # noqa: E402


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def _data(n=40):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))


def _private(net, n=40, q=0.25, steps=3, z=0.0, clip=1.0, seed=0, **kw):
    return ul.private_training(net, DataLoader(_data(n), batch_size=8), unit_of_record=torch.arange(n),
                               num_units=n, sample_rate=q, steps=steps, noise_multiplier=z,
                               clipping_norm=clip, generator=torch.Generator().manual_seed(seed), **kw)


def _sgd(model, loader, lr=1.0, passes=1, steps_per_batch=1):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    for _ in range(passes):
        for x, y in loader:
            for _ in range(steps_per_batch):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y, reduction="mean").backward()
                opt.step()


def test_poisson_batches_yield_exactly_the_planned_steps_over_passes():
    gen = torch.Generator().manual_seed(1)
    sampler = ul.PoissonBatches(torch.arange(100), 100, 0.3, 4, gen, secure=False)
    assert len(sampler) == 4 and sampler.rate == 0.3 and sampler.steps == 4 and sampler.drawn == 0
    first = list(sampler)
    assert len(first) == 4 and sampler.drawn == 4 and list(sampler) == []
    assert all(isinstance(b, list) for b in first)
    assert sampler.current is not None and sampler.current.records.tolist() == first[-1]
    sizes = [len(b) for b in first]
    assert all(10 < s < 55 for s in sizes)  # rate 0.3 of 100 units
    partial = ul.PoissonBatches(torch.arange(10), 10, 1.0, 3, gen, secure=True)
    it = iter(partial)
    assert next(it) == list(range(10))
    assert [b for b in partial] == [list(range(10))] * 2  # a later pass yields what is left
    assert partial.secure is True and partial.generator is gen and partial.num_units == 10


def test_empty_like_keeps_the_structure_with_zero_rows():
    batch = {"x": torch.ones(3, 2), "y": [torch.ones(3), (torch.zeros(3, 1), "tag")], "n": 3}
    empty = ul._empty_like(batch)
    assert type(empty) is dict and empty["x"].shape == (0, 2) and empty["n"] == 3
    assert type(empty["y"]) is list and empty["y"][0].shape == (0,)
    assert type(empty["y"][1]) is tuple and empty["y"][1][0].shape == (0, 1) and empty["y"][1][1] == "tag"


def test_an_empty_sample_is_a_batch_of_zero_rows_and_a_pure_noise_step():
    net = _Tiny()
    for p in net.head.parameters():
        p.requires_grad_(False)
    before = [p.detach().clone() for p in net.body.parameters()]
    seen = []
    with _private(net, q=0.0, steps=2, z=1.0) as (model, loader, record):
        for x, y in loader:
            seen.append((tuple(x.shape), tuple(y.shape)))
            opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    assert seen == [((0, 4), (0,))] * 2 and record.steps_taken == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, net.body.parameters(), strict=True))


def test_a_loader_keeps_the_users_collate_fn():
    net = _Tiny()
    calls = []

    def collate(items):
        calls.append(len(items))
        return torch.utils.data.default_collate(items)

    loader = DataLoader(_data(), batch_size=8, collate_fn=collate)
    with ul.private_training(net, loader, unit_of_record=torch.arange(40), num_units=40, sample_rate=1.0,
                             steps=1, noise_multiplier=0.0, clipping_norm=1.0,
                             generator=torch.Generator().manual_seed(0)) as (model, pl, _):
        assert pl.poisson.steps == 1 and pl.num_workers == 0
        _sgd(model, pl)
    assert calls == [40]


def _reference_sum(net, clip):
    """The clipped per-record gradient sum of the body over the whole data (mean loss)."""
    from opacus import GradSampleModule

    x, y = _data().tensors
    ref = _Tiny()
    ref.load_state_dict(net.state_dict())
    for p in ref.head.parameters():
        p.requires_grad_(False)
    gsm = GradSampleModule(ref, loss_reduction="mean")
    nn.functional.cross_entropy(gsm(x), y).backward()
    want = d.clipped_unit_sum(list(ref.body.parameters()), d.UnitBatch(torch.arange(40), torch.arange(40), 40), clip)
    gsm._close()
    return [w.detach() for w in want]


def test_the_step_is_the_clipped_sum_over_the_expected_batch_plus_noise_of_z_c():
    """lr 1, q = 1, N = 40, z = 0: the move equals -clipped_unit_sum / (q N) exactly."""
    torch.manual_seed(0)
    net = _Tiny()
    for p in net.head.parameters():
        p.requires_grad_(False)
    start = [p.detach().clone() for p in net.body.parameters()]
    want = _reference_sum(net, 0.05)
    with _private(net, q=1.0, steps=1, clip=0.05) as (model, loader, record):
        _sgd(model, loader)
    for p, s, w in zip(net.body.parameters(), start, want, strict=True):
        assert torch.allclose(s - p.detach(), w / 40, atol=1e-7)
        assert p.grad is not None and p.grad.dtype == p.dtype
        assert getattr(p, "grad_sample", None) is None
    assert record.steps_planned == 1 and record.steps_taken == 1 and record.clipped_sum is None


def test_capture_keeps_the_unnoised_clipped_sum_and_moves_nothing():
    torch.manual_seed(0)
    net = _Tiny()
    for p in net.head.parameters():
        p.requires_grad_(False)
    start = [p.detach().clone() for p in net.body.parameters()]
    with _private(net, q=1.0, steps=2, clip=0.05, z=5.0, capture=True) as (model, loader, record):
        _sgd(model, loader)
    assert all(torch.equal(a, b) for a, b in zip(start, net.body.parameters(), strict=True))
    assert record.steps_taken == 2 and len(record.clipped_sum) == 2
    want = _reference_sum(net, 0.05)
    for c, w in zip(record.clipped_sum, want, strict=True):
        assert torch.allclose(c, 2 * w, atol=1e-6)  # the same full batch twice, parameters unmoved
    assert all(p.grad is not None and not p.grad.any() for p in net.body.parameters())


def test_noise_std_and_zero_noise_without_noise_multiplier():
    net = nn.Sequential(nn.Linear(4, 500))
    before = torch.cat([p.detach().ravel().clone() for p in net.parameters()])

    def zero_loss(model, loader):
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        for x, _ in loader:
            opt.zero_grad()
            (0.0 * model(x).sum()).backward()
            opt.step()

    with _private(net, q=0.5, steps=1, z=2.0, clip=0.5) as (model, loader, _):
        zero_loss(model, loader)
    moved = torch.cat([p.detach().ravel() for p in net.parameters()]) - before
    assert float(moved.std()) == pytest.approx(2.0 * 0.5 / (0.5 * 40), rel=0.1)
    assert abs(float(moved.mean())) < 0.01


def test_only_this_models_optimizer_is_hooked_and_the_hook_is_removed():
    net, other = _Tiny(), nn.Linear(2, 2)
    other_opt = torch.optim.SGD(other.parameters(), lr=1.0)
    with _private(net, q=1.0, steps=1) as (model, loader, record):
        other(torch.ones(1, 2)).sum().backward()
        other_opt.step()  # not the private model's: no DP step, no error
        _sgd(model, loader)
    assert record.steps_taken == 1
    other_opt.zero_grad()
    net_opt = torch.optim.SGD(net.parameters(), lr=1.0)
    net(torch.ones(1, 4)).sum().backward()
    net_opt.step()  # after the block: a plain step, the hook is gone
    assert all(getattr(p, "grad_sample", None) is None for p in net.parameters())


def test_a_step_without_a_new_batch_is_an_error():
    net = _Tiny()
    with pytest.raises(ul.UserLoopError, match="^optimizer.step\\(\\) was called without a new batch"):
        with _private(net, q=1.0, steps=2) as (model, loader, _):
            _sgd(model, loader, steps_per_batch=2)
    net = _Tiny()
    with pytest.raises(ul.UserLoopError, match="without a new batch"):
        with _private(net, q=1.0, steps=2) as (model, loader, _):
            torch.optim.SGD(model.parameters(), lr=1.0).step()  # before the first batch


def test_missing_or_wrong_per_sample_gradients_are_named():
    net = _Tiny()
    with pytest.raises(ul.UserLoopError, match=r"^per-sample gradients of a batch of 40 records expected, got none"):
        with _private(net, q=1.0, steps=1) as (model, loader, _):
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            for _x, _y in loader:
                opt.step()  # no backward at all
    net = _Tiny()
    with pytest.raises(ul.UserLoopError, match=r"expected, got list: call loss.backward\(\) exactly once"):
        with _private(net, q=1.0, steps=1) as (model, loader, _):
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            for x, y in loader:
                nn.functional.cross_entropy(model(x), y).backward()
                nn.functional.cross_entropy(model(x), y).backward()  # two backward passes
                opt.step()


def test_no_trainable_parameter_and_an_unsupported_model_are_named():
    net = _Tiny()
    for p in net.parameters():
        p.requires_grad_(False)
    with pytest.raises(ul.UserLoopError, match="^no trainable parameter to train privately$"):
        with _private(net):
            pass
    bn = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    with pytest.raises(ul.UserLoopError, match="^the model cannot be trained with per-sample gradients: "):
        with _private(bn):
            pass


def test_fewer_steps_than_planned_are_logged(caplog):
    net = _Tiny()
    with caplog.at_level(logging.WARNING):
        with _private(net, q=1.0, steps=3) as (model, loader, record):
            for x, y in loader:
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                break
    assert record.steps_taken == 1 and record.steps_planned == 3
    assert any("took 1 of the 3 DP-SGD steps" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        with _private(_Tiny(), q=1.0, steps=1) as (model, loader, record):
            _sgd(model, loader)
    assert not any("DP-SGD steps" in r.getMessage() for r in caplog.records)


def test_sum_loss_reduction_is_passed_to_opacus():
    torch.manual_seed(0)
    net = _Tiny()
    for p in net.head.parameters():
        p.requires_grad_(False)
    with _private(net, q=1.0, steps=1, loss_reduction="sum") as (model, loader, _):
        assert model.loss_reduction == "sum"
    with _private(_Tiny(), q=1.0, steps=1) as (model, loader, _):
        assert model.loss_reduction == "mean"
