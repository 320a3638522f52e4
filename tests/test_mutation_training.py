"""Unit checks of the DP trainers (flwr_jdp/training/dp_sgd.py, user_loop.py)
written to kill surviving mutants (docs/mutation.md): Poisson sampling of units,
the unit index, batch sums, and the released step."""

import math

import numpy as np
import pytest
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
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
        for x, y in loader:
            seen.append((tuple(x.shape), tuple(y.shape)))
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            assert math.isnan(loss.item())
            loss.backward()
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
    for (name, p), s, w in zip(net.body.named_parameters(), start, want, strict=True):
        assert torch.allclose(s - p.detach(), w / 40, atol=1e-7)
        assert torch.equal(record.release[f"body.{name}"], p.detach())
        assert p.grad is None and getattr(p, "grad_sample", None) is None
    assert record.steps_planned == 1 and record.steps_taken == 1 and record.clipped_sum is None
    assert set(record.release) == {"body.weight", "body.bias"}


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


def test_noise_std_and_zero_noise_without_noise_multiplier():
    """The same run with z and with z = 0 (same batches, same generator): the
    releases differ by the noise, std z C / (q N) per coordinate, mean 0."""
    def release(z):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 500))
        with _private(net, q=0.5, steps=1, z=z, clip=0.5) as (model, loader, record):
            _sgd(model, loader)
        return torch.cat([record.release[k].ravel() for k in ("0.weight", "0.bias")])

    moved = release(2.0) - release(0.0)
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


def test_a_step_without_a_new_batch_is_set_aside():
    """A second step on one batch, or a step before the first batch: no DP step there;
    every planned step is still taken, each on its own batch."""
    net = _Tiny()
    with _private(net, q=1.0, steps=2) as (model, loader, record):
        _sgd(model, loader, steps_per_batch=2)
    assert record.steps_taken == 2 and record.steps_completed == 0
    net = _Tiny()
    with _private(net, q=1.0, steps=2) as (model, loader, record):
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        opt.step()  # before the first batch
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert record.steps_taken == 2


def test_a_step_without_a_loss_or_after_two_losses_is_named():
    net = _Tiny()
    with pytest.raises(ul.UserLoopError, match=r"^the train function took no DP step"):
        with _private(net, q=1.0, steps=1) as (model, loader, _):
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            for _x, _y in loader:
                opt.step()  # no loss at all
    net = _Tiny()
    with pytest.raises(ul.UserLoopError, match=r"^without loss_fn, one torch loss per batch.*pass loss_fn="):
        with _private(net, q=1.0, steps=1) as (model, loader, _):
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            for x, y in loader:
                out = model(x)
                nn.functional.cross_entropy(out, y).backward()
                nn.functional.cross_entropy(out, y).backward()  # two losses on one output
                opt.step()


def test_per_record_gradients_of_the_wrong_batch_size_are_named():
    net = _Tiny()
    with pytest.raises(ul.UserLoopError, match=r"^the per-record gradients of this batch are missing"):
        with _private(net, q=1.0, steps=1) as (model, loader, _):
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            for x, y in loader:
                nn.functional.cross_entropy(model(x), y).backward()
                net.body.weight.grad_sample = torch.zeros(3, 3, 4)
                opt.step()


def test_an_empty_sample_of_a_one_record_data_set():
    net = _Tiny()
    data = TensorDataset(torch.ones(1, 4), torch.zeros(1, dtype=torch.long))
    with ul.private_training(net, DataLoader(data), unit_of_record=torch.arange(1), num_units=1,
                             sample_rate=1e-12, steps=1, noise_multiplier=1.0, clipping_norm=1.0,
                             generator=torch.Generator().manual_seed(0)) as (model, loader, _):
        batches = []
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        for x, y in loader:
            batches.append(tuple(x.shape))
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert batches == [(0, 4)]


def test_no_trainable_parameter_and_an_unsupported_model_are_named(monkeypatch):
    net = _Tiny()
    for p in net.parameters():
        p.requires_grad_(False)
    with pytest.raises(ul.UserLoopError, match="^no trainable parameter to train privately$"):
        with _private(net):
            pass
    from flwr_jdp.training import per_sample

    class BackwardNeedsTwo(torch.autograd.Function):  # vmap cannot trace it; one record's backward fails
        @staticmethod
        def forward(ctx, h):
            ctx.rows = h.shape[0]
            return h.view_as(h)

        @staticmethod
        def backward(ctx, g):
            assert ctx.rows > 1
            return g

    class NeedsTwo(_Tiny):
        def forward(self, x):
            return self.head(torch.relu(BackwardNeedsTwo.apply(self.body(x))))

    monkeypatch.setattr(per_sample, "FUNC_FAILED", {})
    with pytest.raises(ul.UserLoopError, match=r"^the model cannot compute a record's gradient on that record "
                                               r"alone \(a batch of one raised AssertionError\)"):
        with _private(NeedsTwo(), q=1.0, steps=1) as (model, loader, _):
            _sgd(model, loader)


def test_steps_the_train_function_leaves_out_are_taken_by_the_pass(caplog):
    """An early stop after one of three steps: the pass takes the other two, on the
    next batches, with the train function's loss and optimizer: the release is the
    one of a loop that took all three."""
    def early(model, loader):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            break

    releases = []
    for fn in (early, lambda m, pl: _sgd(m, pl, lr=0.1)):
        torch.manual_seed(0)
        with caplog.at_level(logging.WARNING), _private(_Tiny(), q=0.5, steps=3, z=1.0) as (model, loader, record):
            fn(model, loader)
        releases.append((record.release, record.steps_taken, record.steps_completed))
    (early_release, taken, completed), (full, full_taken, full_completed) = releases
    assert (taken, completed, full_taken, full_completed) == (3, 2, 3, 0)
    for k, v in full.items():
        assert torch.equal(early_release[k], v)
    assert any("left DP steps untaken" in r.getMessage() for r in caplog.records)


def test_each_records_term_is_used_whatever_the_reduction():
    """The user's mean, sum or per-record ('none') loss: the same per-record terms."""
    releases = []
    for reduction in ("mean", "sum", "none"):
        torch.manual_seed(0)
        net = _Tiny()
        with _private(net, q=1.0, steps=1, clip=0.05) as (model, loader, record):
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            for x, y in loader:
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y, reduction=reduction)
                (loss if reduction != "none" else loss.mean()).backward()
                opt.step()
        releases.append(record.release)
    for other in releases[1:]:
        for k, v in releases[0].items():
            torch.testing.assert_close(other[k], v)


# --------------------------------------------------------------------- dp_sgd
def test_poisson_batches_use_their_generator_and_secure_ones_leave_it_alone():
    gen_a, gen_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    torch.manual_seed(1)
    a = list(ul.PoissonBatches(torch.arange(200), 200, 0.3, 3, gen_a, secure=False))
    torch.manual_seed(2)  # the global generator is not the one used
    b = list(ul.PoissonBatches(torch.arange(200), 200, 0.3, 3, gen_b, secure=False))
    assert a == b
    gen = torch.Generator().manual_seed(5)
    state = gen.get_state()
    list(ul.PoissonBatches(torch.arange(200), 200, 0.3, 3, gen, secure=True))
    assert torch.equal(gen.get_state(), state)


def test_finite_rows_checks_every_parameter_row_by_row():
    g1 = torch.tensor([[np.nan, 1.0], [1.0, 1.0], [1.0, 1.0]])
    g2 = torch.tensor([[1.0], [1.0], [np.inf]])
    assert d.finite_rows([g1, g2]).tolist() == [False, True, False]
    assert d.finite_rows([g2, torch.ones(3, 2)]).tolist() == [True, True, False]


def test_backward_batch_of_an_empty_and_a_one_record_batch():
    from flwr_jdp.models import SeedCNN

    model = SeedCNN(1, 8, 10)
    grads = d._OpacusPerSample(model)
    x, y = torch.randn(3, 1, 8, 8), torch.tensor([1, 2, 3])
    empty = d.UnitBatch(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 0)
    assert math.isnan(grads.backward(x, y, empty))
    one = d.UnitBatch(torch.tensor([1]), torch.tensor([0]), 1)
    loss = grads.backward(x, y, one)
    want = float(torch.nn.functional.cross_entropy(model(x[1:2]), y[1:2]))
    assert loss == pytest.approx(want, rel=1e-5)
    grads.close()
    assert all(getattr(p, "grad_sample", None) is None and p.grad is None for p in model.parameters())


def test_a_torch_func_failure_is_recorded_with_its_first_line(monkeypatch, caplog):
    monkeypatch.setattr(d, "_FUNC_FAILED", {})

    class Odd(nn.Linear):
        pass

    grads = d._PerSampleGrads.__new__(d._PerSampleGrads)
    grads.model = Odd(2, 2)
    with caplog.at_level(logging.WARNING, logger=d.log.name):
        grads._record_failure(RuntimeError("  first line\nsecond line  "))
        grads._record_failure(ValueError("again"))  # once per class
    assert d._FUNC_FAILED == {Odd: "RuntimeError: first line"}
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == [f"per-sample gradients of {Odd.__module__}.{Odd.__qualname__}: torch.func failed "
                    "(RuntimeError: first line); using Opacus hooks"]
    grads.model = nn.Linear(2, 2)
    grads._record_failure(ValueError("   "))
    assert d._FUNC_FAILED[nn.Linear] == "ValueError: "


def test_personal_grads_fast_path_and_the_finite_rows_path():
    shared = nn.Parameter(torch.zeros(2))  # no grad_sample attribute at all
    personal = nn.Parameter(torch.zeros(2))
    personal.grad = torch.tensor([1.0, 2.0])
    batch = d.UnitBatch(torch.arange(2), torch.arange(2), 2)
    assert d._personal_grads([shared], [personal], batch)[0] is personal.grad  # no grad_sample needed
    personal.grad = torch.tensor([np.nan, 2.0])
    personal.grad_sample = torch.tensor([[np.nan, 1.0], [3.0, 1.0]])
    out = d._personal_grads([shared], [personal], batch)
    assert out[0].tolist() == [3.0, 1.0]  # the non-finite record left out
    shared.grad_sample = torch.tensor([[1.0, 1.0], [np.inf, 0.0]])
    personal.grad_sample = torch.tensor([[2.0, 1.0], [3.0, np.nan]])
    assert d._personal_grads([shared], [personal], batch)[0].tolist() == [2.0, 1.0]


def _digits(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g).numpy(), torch.randint(0, 10, (n,), generator=g).numpy()


def _model_and_split(seed=0):
    from flwr_jdp.models import SeedCNN
    from flwr_jdp.params import split_parameters

    torch.manual_seed(seed)
    model = SeedCNN(1, 8, 10)
    return model, split_parameters(model, r"^fc1\.")


def _reference_unit_sum(model, split, x, y, clip, users=None):
    from opacus import GradSampleModule

    gsm = GradSampleModule(model, loss_reduction="sum")
    xt, yt = torch.from_numpy(x), torch.from_numpy(y).long()
    torch.nn.functional.cross_entropy(gsm(xt), yt, reduction="sum").backward()
    params = dict(model.named_parameters())
    shared = [params[n] for n in split.shared]
    unit, k = d._unit_index(len(y), users)
    _, inv = torch.unique(unit, return_inverse=True)
    out = [s.detach().clone() for s in d.clipped_unit_sum(shared, d.UnitBatch(torch.arange(len(y)), inv, k), clip)]
    for p in gsm.parameters():
        p.grad_sample = None
        p.grad = None
    gsm._close()
    return out


UNEVEN = np.array([0, 1, 1, 1, 2, 3, 3, 4, 4, 4, 4, 5, 6, 6, 7, 7])  # 8 users of 1 to 4 records


@pytest.mark.parametrize("users", [None, UNEVEN])
def test_one_noiseless_step_is_minus_lr_times_the_clipped_sum_over_q_n(users):
    x, y = _digits()
    model, split = _model_and_split()
    want = _reference_unit_sum(model, split, x, y, 0.05, users)
    params = dict(model.named_parameters())
    before = {n: params[n].detach().clone() for n in split.shared + split.personal}
    units = 16 if users is None else 8
    loss = d.train_dp_sgd(model, split, x, y, user_ids=users, noise_multiplier=0.0, clipping_norm=0.05,
                          sample_rate=1.0, steps=1, lr=0.7, personal_lr=0.0,
                          generator=torch.Generator().manual_seed(0))
    for name, w in zip(split.shared, want, strict=True):
        assert torch.allclose(params[name].detach(), before[name] - 0.7 * w / units, atol=1e-6)
    for name in split.personal:
        assert torch.equal(params[name].detach(), before[name]) and params[name].requires_grad
    torch.manual_seed(0)
    ref, _ = _model_and_split()
    want_loss = float(torch.nn.functional.cross_entropy(ref(torch.from_numpy(x)), torch.from_numpy(y).long()))
    assert loss == pytest.approx(want_loss, rel=1e-5)


@pytest.mark.parametrize("personal_lr", [0.3, 1.0])
def test_interleaved_personal_step_is_the_mean_gradient(personal_lr):
    x, y = _digits()
    model, split = _model_and_split()
    ref, _ = _model_and_split()
    out = torch.nn.functional.cross_entropy(ref(torch.from_numpy(x)), torch.from_numpy(y).long())
    out.backward()
    rp = dict(ref.named_parameters())
    params = dict(model.named_parameters())
    before = {n: params[n].detach().clone() for n in split.personal}
    d.train_dp_sgd(model, split, x, y, user_ids=None, noise_multiplier=0.0, clipping_norm=0.05,
                   sample_rate=1.0, steps=1, lr=0.0, personal_lr=personal_lr,
                   generator=torch.Generator().manual_seed(0))
    for n in split.personal:
        assert torch.allclose(params[n].detach(), before[n] - personal_lr * rp[n].grad, atol=1e-6)


def test_the_noise_of_a_step_is_z_c_over_q_n_times_lr():
    x, y = _digits(32)
    model, split = _model_and_split()
    params = dict(model.named_parameters())
    before = torch.cat([params[n].detach().ravel().clone() for n in split.shared])
    z, clip, q, lr = 3.0, 1e-6, 0.5, 2.0
    loss = d.train_dp_sgd(model, split, x, y, user_ids=None, noise_multiplier=z, clipping_norm=clip,
                          sample_rate=q, steps=1, lr=lr, personal_lr=0.0,
                          generator=torch.Generator().manual_seed(4))
    moved = torch.cat([params[n].detach().ravel() for n in split.shared]) - before
    assert float(moved.std()) == pytest.approx(lr * z * clip / (q * 32), rel=0.1)
    assert math.isfinite(loss)


def test_an_empty_sample_is_a_pure_noise_step_and_the_loss_is_nan():
    x, y = _digits(8)
    model, split = _model_and_split()
    params = dict(model.named_parameters())
    before = torch.cat([params[n].detach().ravel().clone() for n in split.shared])
    loss = d.train_dp_sgd(model, split, x, y, user_ids=None, noise_multiplier=1.0, clipping_norm=1.0,
                          sample_rate=1e-12, steps=2, lr=1.0, personal_lr=0.1,
                          generator=torch.Generator().manual_seed(0))
    moved = torch.cat([params[n].detach().ravel() for n in split.shared]) - before
    assert math.isnan(loss) and float(moved.std()) > 0
    assert math.isnan(d.train_dp_sgd(model, split, x, y, user_ids=None, noise_multiplier=0.0, clipping_norm=1.0,
                                     sample_rate=0.5, steps=0, lr=1.0, personal_lr=0.0,
                                     generator=torch.Generator().manual_seed(0)))


def test_secure_training_and_sampling_leave_the_generator_alone():
    x, y = _digits(8)
    model, split = _model_and_split()
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    d.train_dp_sgd(model, split, x, y, user_ids=None, noise_multiplier=1.0, clipping_norm=1.0,
                   sample_rate=0.5, steps=2, lr=0.1, personal_lr=0.1, generator=gen, secure_noise=True)
    d.clipped_gradient_sum(model, split, x, y, user_ids=None, clipping_norm=1.0, sample_rate=0.5,
                           generator=gen, secure_noise=True)
    assert torch.equal(gen.get_state(), state)


@pytest.mark.parametrize("users", [None, UNEVEN])
def test_central_clipped_sum_is_the_unnoised_unit_sum(users):
    x, y = _digits()
    model, split = _model_and_split()
    want = _reference_unit_sum(model, split, x, y, 0.05, users)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    sums, units = d.clipped_gradient_sum(model, split, x, y, user_ids=users, clipping_norm=0.05,
                                         sample_rate=1.0, generator=torch.Generator().manual_seed(0))
    assert units == (16 if users is None else 8)
    assert all(isinstance(s, np.ndarray) for s in sums) and len(sums) == len(split.shared)
    for s, w in zip(sums, want, strict=True):
        assert np.allclose(s, w.numpy(), atol=1e-6)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())
    empty, k = d.clipped_gradient_sum(model, split, x, y, user_ids=users, clipping_norm=0.05,
                                      sample_rate=0.0, generator=torch.Generator().manual_seed(0))
    assert k == 0 and all(not e.any() for e in empty)


def test_the_mean_loss_leaves_out_empty_samples(monkeypatch):
    x, y = _digits(8)
    model, split = _model_and_split()
    ref, _ = _model_and_split()
    want = float(torch.nn.functional.cross_entropy(ref(torch.from_numpy(x)), torch.from_numpy(y).long()))
    draws = iter([d.UnitBatch(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 0),
                  d.UnitBatch(torch.arange(8), torch.arange(8), 8)])
    monkeypatch.setattr(d, "_draw_batch", lambda *a: next(draws))
    loss = d.train_dp_sgd(model, split, x, y, user_ids=None, noise_multiplier=0.0, clipping_norm=1.0,
                          sample_rate=0.5, steps=2, lr=0.0, personal_lr=0.0,
                          generator=torch.Generator().manual_seed(0))
    assert loss == pytest.approx(want, rel=1e-5)


def test_the_users_loop_draws_noise_from_its_generator():
    def run(global_seed):
        torch.manual_seed(0)
        net = _Tiny()
        torch.manual_seed(global_seed)
        with _private(net, q=0.5, steps=2, z=1.0, seed=11) as (model, loader, _):
            _sgd(model, loader)
        return torch.cat([p.detach().ravel() for p in net.parameters()])

    assert torch.equal(run(1), run(2))


def test_batch_sums_of_an_empty_and_a_one_record_batch():
    p = nn.Parameter(torch.zeros(3))
    p.grad_sample = torch.tensor([[3.0, 0.0, 4.0]])
    one = d.batch_sums([p], d.UnitBatch(torch.tensor([0]), torch.tensor([0]), 1), 1.0)
    assert torch.allclose(one[0], torch.tensor([0.6, 0.0, 0.8]), atol=1e-6)
    empty = d.batch_sums([p], d.UnitBatch(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), 0), 1.0)
    assert len(empty) == 1 and empty[0].shape == (3,) and not empty[0].any()


def test_the_per_sample_backend_is_chosen_as_configured(monkeypatch):
    from flwr_jdp.training import per_sample

    model = nn.Sequential(nn.Linear(3, 2))
    monkeypatch.setattr(per_sample, "BACKEND", "opacus")
    grads = d._PerSampleGrads(model, ())
    assert grads.name == "opacus"
    grads.close()
    monkeypatch.setattr(per_sample, "BACKEND", "auto")
    grads = d._PerSampleGrads(model, ())
    assert grads.name != "opacus"
    grads.close()
    monkeypatch.setattr(d, "_FUNC_FAILED", {nn.Sequential: "earlier failure"})
    grads = d._PerSampleGrads(model, ())
    assert grads.name == "opacus"
    grads.close()


def test_unit_index_casts_user_ids_to_int64():
    idx, n = d._unit_index(2, np.array([0.0, 1.0]))
    assert idx.dtype == torch.int64 and n == 2


def test_a_model_torch_func_refuses_falls_back_to_opacus_or_fails_under_func(monkeypatch):
    from flwr_jdp.training import per_sample

    monkeypatch.setattr(d, "_FUNC_FAILED", {})
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2, affine=False, track_running_stats=False))
    monkeypatch.setattr(per_sample, "BACKEND", "auto")
    grads = d._PerSampleGrads(model, ())
    assert grads.name == "opacus"
    assert d._FUNC_FAILED == {nn.Sequential: "FuncUnsupported: BatchNorm1d mixes the records of a batch"}
    grads.close()
    monkeypatch.setattr(per_sample, "BACKEND", "func")
    with pytest.raises(per_sample.FuncUnsupported):
        d._PerSampleGrads(model, ())


def test_a_non_finite_loss_is_left_out_of_the_mean(monkeypatch):
    x, y = _digits(8)
    x[0] = np.nan  # record 0's loss is NaN (its gradient is zeroed before clipping)
    model, split = _model_and_split()
    ref, _ = _model_and_split()
    want = float(torch.nn.functional.cross_entropy(ref(torch.from_numpy(x[1:])), torch.from_numpy(y[1:]).long()))
    draws = iter([d.UnitBatch(torch.tensor([0]), torch.tensor([0]), 1),
                  d.UnitBatch(torch.arange(1, 8), torch.arange(7), 7)])
    monkeypatch.setattr(d, "_draw_batch", lambda *a: next(draws))
    loss = d.train_dp_sgd(model, split, x, y, user_ids=None, noise_multiplier=0.0, clipping_norm=1.0,
                          sample_rate=0.5, steps=2, lr=0.0, personal_lr=0.0,
                          generator=torch.Generator().manual_seed(0))
    assert loss == pytest.approx(want, rel=1e-5)
