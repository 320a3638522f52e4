"""What the drop-in's DP pass remembers between rounds, and its cheaper row check, change
no release.

- The dry run runs the train function every round: a new closure with another learning
  rate (the README's ``lambda net, loader: train_fn(..., msg.content["config"]["lr"])``)
  gives the release of that learning rate, never a stale one.
- The dry run's gradient check (a record's gradient on synthetic records) is skipped only
  where everything it depends on is unchanged: the model's code, the loss and its
  arguments, the per-record path; any of them changed runs it again.
- A batch of torch's ``default_collate`` over records of one layout is split by rows
  without collating each record again, with the verdict of the record-by-record check.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate

from flwr_jdp.training import per_sample
from flwr_jdp.training.dp_pass import capture, dry_run, plan
from flwr_jdp.training.dp_pass.batches import _rows_are_records, _stacked_by_default_collate
from tests.test_dropin import Tiny
from tests.test_dropin_guarantee import _release, _round, _sgd_loop


def test_a_new_learning_rate_in_the_closure_gives_its_own_release():
    """One DP step (SGD, same noise seed): the release is ``broadcast - lr g`` with the same
    noised ``g`` whatever ``lr``, so it is linear in the closure's learning rate, and the
    same learning rate again gives the same release."""
    def closure(lr: float):  # noqa: ANN202 - a new function each round, as in the README
        return lambda net, loader: _sgd_loop(lr=lr)(net, loader)

    r5, r1, r3, again = (_release(_round("local", closure(lr))) for lr in (0.5, 0.1, 0.3, 0.5))
    np.testing.assert_array_equal(again, r5)
    assert np.abs(r5 - r1).max() > 1e-4
    np.testing.assert_allclose(r5 - r3, r3 - r1, rtol=1e-4, atol=1e-6)


def test_momentum_set_in_a_later_round_reaches_the_release():
    """Settings other than the learning rate too: the same code with momentum is another
    optimizer (two steps: momentum moves the second)."""
    def loop(momentum: float):  # noqa: ANN202
        def fn(net: nn.Module, loader: DataLoader) -> None:
            opt = torch.optim.SGD(net.parameters(), lr=0.5, momentum=momentum)
            for x, y in loader:
                opt.zero_grad()
                F.cross_entropy(net(x), y).backward()
                opt.step()
        return fn

    from tests.test_dropin_guarantee import _multi_step_round

    plain, heavy = (_release(_multi_step_round("local", loop(m), steps=2)) for m in (0.0, 0.9))
    assert np.abs(plain - heavy).max() > 1e-4
    np.testing.assert_array_equal(_release(_multi_step_round("local", loop(0.0), steps=2)), plain)


class _Other(Tiny):
    def forward(self, x):  # noqa: ANN001, ANN201
        return self.head(torch.tanh(self.body(x)))


def _probes(monkeypatch, model: nn.Module, loss=F.cross_entropy) -> int:  # noqa: ANN001
    """The gradient checks one dry run runs (calls of the per-record gradients outside
    the dry run's own pass)."""
    calls = []
    original = capture._DPPass._gradients  # noqa: SLF001

    def counted(self, *args):  # noqa: ANN001, ANN002, ANN202
        if not self.dry:
            calls.append(1)
        return original(self, *args)

    monkeypatch.setattr(capture._DPPass, "_gradients", counted)  # noqa: SLF001

    def train(net: nn.Module, loader: DataLoader) -> None:
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for x, y in loader:
            opt.zero_grad()
            loss(net(x), y).backward()
            opt.step()

    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(10, 4, generator=g), torch.randint(0, 2, (10,), generator=g)),
                      batch_size=4)
    dry_run(model, data, train, capture=False)
    monkeypatch.undo()
    return len(calls)


def test_the_gradient_check_runs_again_when_what_it_depends_on_changes(monkeypatch):
    plan._GRADIENTS_CHECKED.clear()  # noqa: SLF001
    assert _probes(monkeypatch, Tiny()) == 1
    assert _probes(monkeypatch, Tiny()) == 0  # same code, loss, layout: checked already
    assert _probes(monkeypatch, _Other()) == 1  # another forward
    smoothed = lambda out, y: F.cross_entropy(out, y, label_smoothing=0.1)  # noqa: E731
    assert _probes(monkeypatch, Tiny(), smoothed) == 1  # another loss argument
    frozen = Tiny()
    frozen.body.bias.requires_grad_(False)
    assert _probes(monkeypatch, frozen) == 1  # other trainable parameters
    monkeypatch.setattr(per_sample, "BACKEND", "micro")
    assert _probes(monkeypatch, Tiny()) == 1  # another per-record path
    hooked = Tiny()
    hooked.body.register_forward_hook(lambda m, i, o: o * 2)
    assert _probes(monkeypatch, hooked) == 1  # a hook on a module


def test_the_row_check_of_default_collate_agrees_with_collating_each_record():
    g = torch.Generator().manual_seed(0)
    slow = lambda items: default_collate(items)  # noqa: E731 - not default_collate itself: the record-by-record check
    layouts = {
        "tuples": [(torch.randn(3, generator=g), torch.tensor(i)) for i in range(5)],
        "dicts": [{"img": torch.randn(1, 2, 2, generator=g), "label": torch.tensor(i)} for i in range(5)],
        "keys in another order": [{"a": torch.zeros(2), "b": torch.ones(1)}, {"b": torch.ones(1), "a": torch.zeros(2)}],
        "numbers": [(torch.randn(2, generator=g), i) for i in range(4)],
    }
    for name, items in layouts.items():
        try:
            batch = default_collate(items)
        except Exception:  # noqa: BLE001 - a layout default_collate refuses has no batch to check
            continue
        assert _rows_are_records(batch, items, default_collate) == _rows_are_records(batch, items, slow), name
    assert _stacked_by_default_collate(layouts["tuples"], default_collate)
    assert _stacked_by_default_collate(layouts["dicts"], default_collate)
    assert not _stacked_by_default_collate(layouts["tuples"], slow)  # a user's collate_fn: record by record
    assert not _stacked_by_default_collate(layouts["keys in another order"], default_collate)
    assert not _stacked_by_default_collate(layouts["numbers"], default_collate)
    items = layouts["tuples"]
    batch = default_collate(items)
    batch[0][2] += 1  # a batch that is not these records' collate: the slow check says so
    assert not _rows_are_records(batch, items, slow)
