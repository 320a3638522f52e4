"""The user's own training loop (the drop-in client half) gets the same per-sample
gradients from whole-model ``torch.func`` (the default) as from Opacus's hooks.

:func:`~flwr_jdp.training.user_loop.private_training` hands the user's train
function a :class:`~flwr_jdp.training.user_loop.PrivateModule`: its forward pass is
plain, and the user's ``loss.backward()`` gives, through the loss's gradient in the
model's output, every record's gradient by one vectorised ``torch.func`` pass
(:class:`~flwr_jdp.training.per_sample.FuncGradSampleModule`). It must release what
Opacus's hooks release, for any per-record loss (mean or sum reduced, a sequence
loss), on the four model families of ``tests/test_per_sample_paths.py``, record
and user units, central (the clipped sum) and local noise (the parameters after
noiseless steps with the user's momentum optimizer); a model it cannot handle
(dropout) falls back to Opacus with one log line, before its output is used.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flwr_jdp.training import per_sample, user_loop
from flwr_jdp.training.user_loop import UserLoopError, private_training
from tests.test_per_sample_paths import MODELS, _case

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")


def _loss(out: torch.Tensor, y: torch.Tensor, reduction: str) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction=reduction)  # the LSTM's (n, classes, positions) too


def _train_fn(reduction: str, lr: float = 0.3):
    def train(model: nn.Module, loader: DataLoader) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        model.train()
        for _ in range(2):  # two passes: the loader yields the planned steps in total
            for xb, yb in loader:
                opt.zero_grad()
                _loss(model(xb), yb, reduction).backward()
                opt.step()
    return train


def _run(backend: str, monkeypatch, name: str, unit: str, *, capture: bool, reduction: str = "mean",
         steps: int = 3) -> tuple[list[torch.Tensor], str, nn.Module]:
    monkeypatch.setattr(per_sample, "BACKEND", backend)
    model, split, x, y = _case(name)
    for n, p in model.named_parameters():
        p.requires_grad_(n in split.shared)  # the release's model: personal parameters frozen
    n = len(y)
    units = torch.arange(n) if unit == "record" else torch.arange(n) % 5
    data = DataLoader(TensorDataset(torch.as_tensor(x), torch.as_tensor(y)), batch_size=4)
    with private_training(model, data, unit_of_record=units, num_units=int(units.max()) + 1, sample_rate=0.8,
                         steps=1 if capture else steps, noise_multiplier=0.0, clipping_norm=0.5,
                         generator=torch.Generator().manual_seed(4), capture=capture,
                         loss_reduction=reduction) as (private, loader, record):
        _train_fn(reduction)(private, loader)
        path = private.path
    assert not any(getattr(p, "grad_sample", None) is not None for p in model.parameters())
    if capture:
        return record.clipped_sum, path, model
    return [p.detach().clone() for p in model.parameters()], path, model


@pytest.mark.parametrize("unit", ["record", "user"])
@pytest.mark.parametrize("name", MODELS)
def test_the_users_loop_gives_the_same_clipped_sum_on_both_paths(name, unit, monkeypatch):
    fast, path, _ = _run("auto", monkeypatch, name, unit, capture=True)
    hooks, _, _ = _run("opacus", monkeypatch, name, unit, capture=True)
    assert path == "torch.func"
    assert any(float(s.abs().max()) > 0 for s in fast)
    for a, b in zip(fast, hooks, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=1e-6 * max(1.0, float(b.abs().max())))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", MODELS)
def test_noiseless_steps_of_the_users_optimizer_end_at_the_same_parameters(name, reduction, monkeypatch):
    fast, path, model = _run("auto", monkeypatch, name, "record", capture=False, reduction=reduction)
    hooks, _, _ = _run("opacus", monkeypatch, name, "record", capture=False, reduction=reduction)
    start, _, _, _ = _case(name)
    assert path == "torch.func"
    moved = [not torch.equal(a, b) for a, b in zip(fast, start.parameters(), strict=True)]
    shared = [p.requires_grad for p in model.parameters()]
    assert moved == shared  # the shared parameters moved, the frozen personal ones did not
    for a, b in zip(fast, hooks, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


class _Dropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.relu(self.body(x))))


def _dropout_round(backend: str, monkeypatch) -> tuple[list[torch.Tensor], str]:
    monkeypatch.setattr(per_sample, "BACKEND", backend)
    torch.manual_seed(2)
    model = _Dropout()
    x, y = torch.randn(10, 6), torch.randint(0, 3, (10,))
    data = DataLoader(TensorDataset(x, y), batch_size=5)
    torch.manual_seed(7)  # the dropout masks
    with private_training(model, data, unit_of_record=torch.arange(10), num_units=10, sample_rate=0.9, steps=1,
                         noise_multiplier=0.0, clipping_norm=0.2, generator=torch.Generator().manual_seed(1),
                         capture=True) as (private, loader, record):
        _train_fn("mean")(private, loader)
        path = private.path
    return record.clipped_sum, path


def test_a_model_with_dropout_falls_back_to_opacus_with_one_log_line(monkeypatch, caplog):
    monkeypatch.setattr(per_sample, "LINEARIZED_FAILED", {})
    with caplog.at_level(logging.WARNING):
        runs = [_dropout_round("auto", monkeypatch) for _ in range(2)]
    lines = [r for r in caplog.records if "torch.func cannot handle" in r.getMessage()]
    assert len(lines) == 1 and "_Dropout" in lines[0].getMessage()
    assert [path for _, path in runs] == ["opacus", "opacus"]
    hooks, _ = _dropout_round("opacus", monkeypatch)
    for sums, _ in runs:  # the same masks: the fallback recomputed the batch with Opacus
        for a, b in zip(sums, hooks, strict=True):
            torch.testing.assert_close(a, b)
    monkeypatch.setattr(per_sample, "LINEARIZED_FAILED", {})
    with pytest.raises(Exception, match="randomness|random"):  # FLWR_JDP_PER_SAMPLE=func: no fallback
        _dropout_round("func", monkeypatch)


def test_two_backward_passes_in_one_step_are_refused_on_both_paths(monkeypatch):
    def twice(model: nn.Module, loader: DataLoader) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()

    for backend in ("auto", "opacus"):
        monkeypatch.setattr(per_sample, "BACKEND", backend)
        model, split, x, y = _case("quickstart", n=6)
        for n, p in model.named_parameters():
            p.requires_grad_(n in split.shared)
        data = DataLoader(TensorDataset(torch.as_tensor(x), torch.as_tensor(y)), batch_size=6)
        with pytest.raises(UserLoopError, match="exactly once per batch"), \
                private_training(model, data, unit_of_record=torch.arange(6), num_units=6, sample_rate=1.0,
                                 steps=1, noise_multiplier=0.0, clipping_norm=1.0,
                                 generator=torch.Generator().manual_seed(0), capture=True) as (private, loader, _):
            twice(private, loader)


def test_the_drop_in_release_runs_through_torch_func_by_default(monkeypatch):
    """Opacus made unusable: the quickstart model's round must not need it."""
    monkeypatch.setattr(per_sample, "BACKEND", "auto")

    def no_opacus(self) -> None:  # noqa: ANN001
        raise AssertionError("Opacus's hooks were used")

    monkeypatch.setattr(user_loop.PrivateModule, "_use_opacus", no_opacus)
    sums, path, _ = _run("auto", monkeypatch, "quickstart", "record", capture=True)
    assert path == "torch.func" and all(np.isfinite(s.numpy()).all() for s in sums)


def _capture_round(model: nn.Module, x: torch.Tensor, y: torch.Tensor, train_fn=None):  # noqa: ANN001
    data = DataLoader(TensorDataset(x, y), batch_size=len(y))
    with private_training(model, data, unit_of_record=torch.arange(len(y)), num_units=len(y), sample_rate=1.0,
                         steps=1, noise_multiplier=0.0, clipping_norm=1.0, generator=torch.Generator().manual_seed(0),
                         capture=True) as (private, loader, record):
        (train_fn or _train_fn("mean"))(private, loader)
        path = private.path
    return record.clipped_sum, path


def test_the_probes_verdict_is_per_model_kind_not_per_class(monkeypatch):
    """A plain ``nn.Sequential`` passes the probe; a later ``nn.Sequential`` with dropout
    is another kind: probed again, it falls back instead of failing in backward."""
    monkeypatch.setattr(per_sample, "BACKEND", "auto")
    monkeypatch.setattr(per_sample, "LINEARIZED_FAILED", {})
    monkeypatch.setattr(per_sample, "_LINEARIZED_OK", set())
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    torch.manual_seed(0)
    _, path = _capture_round(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)), x, y)
    assert path == "torch.func"
    _, path = _capture_round(nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.5), nn.Linear(5, 3)), x, y)
    assert path == "opacus"


def test_the_models_training_mode_is_left_as_the_users_loop_set_it(monkeypatch):
    monkeypatch.setattr(per_sample, "BACKEND", "auto")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).eval()

    def no_mode_change(m: nn.Module, loader: DataLoader) -> None:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(m(xb), yb).backward()
            opt.step()

    _capture_round(model, torch.randn(6, 4), torch.randint(0, 3, (6,)), no_mode_change)
    assert not model.training


class _CentresTheBatch(nn.Module):
    """Subtracts the batch mean: a record's output depends on the other records."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.b = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h - h.mean(0, keepdim=True))


def test_a_model_that_mixes_the_records_of_a_batch_is_refused(monkeypatch):
    """No per-record gradient exists: refused (not sent to Opacus's hooks, which
    cannot bound one record's influence either)."""
    monkeypatch.setattr(per_sample, "BACKEND", "auto")
    monkeypatch.setattr(per_sample, "_LINEARIZED_OK", set())
    torch.manual_seed(0)
    with pytest.raises(UserLoopError, match="depends on the other records of its batch"):
        _capture_round(_CentresTheBatch(), torch.randn(6, 4), torch.randint(0, 3, (6,)))


@pytest.mark.parametrize("backend", ["func", "opacus"])
def test_the_train_function_reaches_the_models_own_attributes(backend, monkeypatch):
    """Inside the private passes the user's train function gets the model wrapped
    (parameters named ``_module.<name>``, as Opacus names them); the model's own
    attributes and methods (``net.fc``, ``net.head_only()``) are still the model's."""
    monkeypatch.setattr(per_sample, "BACKEND", backend)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(3, 4)
            self.fc = nn.Linear(4, 2)
            self.scale = 2.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(torch.relu(self.body(x))) * self.scale

        def head_only(self) -> list[nn.Parameter]:
            return list(self.fc.parameters())

    net = Net()
    data = DataLoader(TensorDataset(torch.randn(8, 3), torch.randint(0, 2, (8,))), batch_size=4)
    with private_training(net, data, unit_of_record=torch.arange(8), num_units=8, sample_rate=0.5, steps=1,
                          noise_multiplier=0.0, clipping_norm=1.0,
                          generator=torch.Generator().manual_seed(0)) as (private, loader, _):
        assert private.fc is net.fc and private.scale == 2.0
        assert private.head_only() == list(net.fc.parameters())
        assert {n for n, _ in private.named_parameters()} == {f"_module.{n}" for n, _ in net.named_parameters()}
        with pytest.raises(AttributeError):
            _ = private.no_such_attribute


def _epochs_loop(epochs: int, per_pass: list[int]):
    def train(model: nn.Module, loader: DataLoader) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(epochs):
            n = 0
            for xb, yb in loader:
                opt.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                opt.step()
                n += 1
            per_pass.append(n)
    return train


@pytest.mark.parametrize("loop_epochs,local_epochs,expected,warned", [
    (3, 3, [2, 2, 2], False),   # the user's epochs = local-epochs: one epoch's steps per pass
    (3, 1, [6, 0, 0], True),    # the user loops 3 epochs, the owners agreed to 1: said once
    (1, 3, [2], True),          # fewer passes than epochs: fewer steps than charged, said
])
def test_each_pass_over_the_private_loader_is_one_epoch_of_the_schedule(loop_epochs, local_epochs, expected,
                                                                       warned, caplog, monkeypatch):
    monkeypatch.setitem(user_loop._WARNED, "epochs", False)
    net = nn.Linear(3, 2)
    data = DataLoader(TensorDataset(torch.randn(16, 3), torch.randint(0, 2, (16,))), batch_size=4)
    per_pass: list[int] = []
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addHandler(caplog.handler)
    try:
        for _ in range(2):  # two rounds: the too-many-epochs warning is given once per process
            per_pass.clear()
            with private_training(net, data, unit_of_record=torch.arange(16), num_units=16, sample_rate=0.25,
                                  steps=6, noise_multiplier=1.0, clipping_norm=1.0, epochs=local_epochs,
                                  generator=torch.Generator().manual_seed(0)) as (private, loader, _):
                assert len(loader) == (6 if local_epochs == 1 else 2)
                _epochs_loop(loop_epochs, per_pass)(private, loader)
            assert per_pass == expected
    finally:
        flwr_logger.removeHandler(caplog.handler)
    messages = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    if not warned:
        assert messages == []
    elif loop_epochs > local_epochs:
        assert len(messages) == 1 and "local-epochs = 3" in messages[0]
    else:
        assert len(messages) == 2 and all("took 2 of the 6 DP-SGD steps" in m for m in messages)


@pytest.mark.parametrize("backend", ["func", "opacus"])
def test_a_train_function_that_unfreezes_or_steps_twice_on_one_batch_is_refused(backend, monkeypatch):
    """Parameters outside the release (frozen personal layers) that the train function
    unfreezes never move: the torch.func path gives them no gradient, and a gradient
    Opacus's hooks let through is refused; a batch drawn but not stepped on (which
    would let the next batch take two steps) is refused on both paths."""
    monkeypatch.setattr(per_sample, "BACKEND", backend)
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    net[1].requires_grad_(False)  # the "personal" layer, held at its public values
    before = [p.detach().clone() for p in net[1].parameters()]
    data = DataLoader(TensorDataset(torch.randn(16, 3), torch.randint(0, 2, (16,))), batch_size=4)

    def unfreezing(model, loader):
        model.requires_grad_(True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()

    def peeking(model, loader):
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        it = iter(loader)
        next(it)  # drawn, never stepped on
        xb, yb = next(it)
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()

    def run(fn):
        with private_training(net, data, unit_of_record=torch.arange(16), num_units=16, sample_rate=0.5,
                              steps=4, noise_multiplier=1.0, clipping_norm=1.0,
                              generator=torch.Generator().manual_seed(0)) as (private, loader, _):
            fn(private, loader)

    if backend == "opacus":
        with pytest.raises(UserLoopError, match="outside the private release"):
            run(unfreezing)
    else:
        run(unfreezing)
    assert all(torch.equal(a, b) for a, b in zip(before, net[1].parameters(), strict=True))
    net.requires_grad_(True)
    net[1].requires_grad_(False)
    with pytest.raises(UserLoopError, match="one step per batch"):
        run(peeking)
