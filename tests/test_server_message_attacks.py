"""Fields of the server's messages that the threat table of docs/guarantees.md lists
and no other file attacks: the broadcast model, the public personal values of the
set-up, and distributed noise's ``scale``.

- A server may send any shared parameters and any "public" personal values. The
  release is still a DP-SGD step from them: on neighbouring data sets (one record
  replaced) with the same noise seed, it moves by at most ``lr 2C / (qN)`` (local) or
  ``2C`` (central), however large or adversarial those values are.
- Distributed noise: a ``scale`` below ``1 / clipping-norm`` (or not a number) is
  refused by every owner before any data is read, and nothing is charged.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import protocol
from flwr_jdp.strategies import JointDP
from tests.test_distributed_noise import _initial, _rc, user_app
from tests.test_dropin import Tiny, _client_node
from tests.test_dropin_guarantee import PLACEMENTS, N, Q, Z, _bound, _config, _neighbours, _release, _sgd_loop


def _crafted_round(placement: str, loader, scale: float):  # noqa: ANN001
    """One round whose set-up sends personal values and whose train message sends
    shared parameters of magnitude ``scale`` (the same for neighbouring runs)."""
    app, jdp, ctx, loader = _client_node(_config(placement), loader)
    InProcessGrid(app, 1, ctx.run_config)  # stamps message identities
    g = torch.Generator().manual_seed(11)
    net = Tiny()
    crafted = {n: (scale * torch.randn(p.shape, generator=g)).numpy() for n, p in net.named_parameters()}
    public = {n: a for n, a in crafted.items() if n.startswith("head.")}
    shared = {n: a for n, a in crafted.items() if not n.startswith("head.")}
    query = Message(RecordDict({protocol.CONFIG: ConfigRecord(), protocol.PUBLIC_PERSONAL: protocol.to_record(public)}),
                    dst_node_id=7, message_type=MessageType.QUERY)
    assert app(query, ctx).has_content()
    cfg = ConfigRecord({protocol.ROUND: 1, protocol.OWNERS: [0], protocol.SAMPLE_RATES: [Q], protocol.STEPS: [1],
                        protocol.NOISE_MULTIPLIER: Z, protocol.SESSION: "s1"})
    train = Message(RecordDict({protocol.SHARED: protocol.to_record(shared), protocol.CONFIG: cfg}),
                    dst_node_id=7, message_type=MessageType.TRAIN)
    torch.manual_seed(0)
    return jdp.train(train, ctx, Tiny(), loader, _sgd_loop())


@pytest.mark.parametrize("scale", [1.0, 1e3])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_crafted_broadcast_and_public_personal_values_keep_the_dp_sgd_bound(placement, scale):
    moves = []
    for i in range(N):
        a, b = _neighbours(i)
        moves.append(float(np.linalg.norm(_release(_crafted_round(placement, a, scale))
                                          - _release(_crafted_round(placement, b, scale)))))
    assert max(moves) <= _bound(placement) * (1 + 1e-4), (max(moves), _bound(placement))
    assert max(moves) > 0.2 * _bound(placement)  # records do move it: the check has something to bound


class ScaleGrid(InProcessGrid):
    """The server's train messages carry ``scale`` instead of the planned one."""

    def __init__(self, nodes: int, rc: dict, scale: float, node_config: dict) -> None:
        super().__init__(user_app(), nodes, rc, errors_as_replies=True, node_config=node_config)
        self.scale = scale

    def send_and_receive(self, messages, *, timeout=None):  # noqa: ANN001, ANN201
        for msg in messages:
            rec = msg.content.config_records.get(protocol.CONFIG) if msg.has_content() else None
            if msg.metadata.message_type == MessageType.TRAIN and rec is not None and protocol.SCALE in rec:
                rec[protocol.SCALE] = self.scale
        return super().send_and_receive(messages, timeout=timeout)


@pytest.mark.parametrize("scale", [1e-3, float("nan")])
def test_a_distributed_scale_below_one_over_the_clip_is_refused_before_any_charge(tmp_path, scale):
    rc = _rc(3, **{"results-dir": str(tmp_path / "results"), "max-skipped-rounds": 1, "num-rounds": 1})
    grid = ScaleGrid(3, rc, scale, {"state-dir": str(tmp_path / "node")})
    with pytest.raises(Exception):  # noqa: B017, PT011 - every owner refuses: the run fails
        JointDP.from_run_config(rc, node_settle_s=0.0).start(grid=grid, initial_arrays=_initial())
    refusals = [r.error.reason for r in grid.sent if r.metadata.message_type == MessageType.TRAIN and r.has_error()]
    assert refusals and all("scale" in reason and "1 / clipping-norm" in reason for reason in refusals), refusals
    assert not list((tmp_path / "node").rglob("ledger-*.json"))
