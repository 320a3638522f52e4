"""A node's side of the secure sum: Flower's SecAgg+ client mod, with every stage's
message checked against what the node itself saw, and a consistency round of
flwr-jdp's own before any share is revealed.

Flower's ``secaggplus_mod`` masks the node's vector and answers the server's unmask
request; it checks little of what the server sends. :func:`secure_sum_mod` wraps it
and keeps, in the node's ``context.state`` (record :data:`STATE`), what this node saw
of the current SecAgg+ session (one session per round, from its set-up stage on):

- set-up: the field and encoding flwr-jdp uses, unit weights, and a reconstruction
  threshold ``t`` with ``t >= 3`` and ``t > n / 2`` (``n``: the nodes the secrets are
  shared among), so that no two disjoint sets of nodes both reach ``t``
  (:func:`minimum_threshold`);
- share keys: the nodes whose public keys it gets (the key set ``K``) include itself,
  at least ``t`` and at most ``n`` of them;
- collect: key shares from exactly every other node of ``K``, so the node masks its
  vector with a pairwise mask for each of them (no neighbourhood the server picks);
- consistency (:data:`CONSISTENCY`, flwr-jdp's own stage, answered here; Flower's mod
  never sees it): the server names the survivors ``U`` (the nodes whose masked vectors
  it holds); the node checks ``U`` within ``K``, itself in it, ``|U| >= t``, and answers,
  for every other node ``Z`` of ``U``, its :func:`confirmation` of ``U`` for ``Z``: an
  HMAC-SHA256 under a key derived from the pairwise key the two agreed on with Flower's
  key agreement (the one Flower's mod encrypts their key shares with), over the sender,
  the receiver, ``K`` with its public keys, and the sorted ``U``;
- unmask: the request carries the confirmations for this node the server holds (taken
  out before Flower's mod sees the request); the node answers only if the lists are
  active ``= U`` and dead the rest of ``K`` and every other node of ``U`` confirmed that ``U``
  to it; once per session, and every stage only in order.

Why a server that tells nodes different survivors learns only a sum over one ``U``:
an honest node reveals shares (of the seeds of ``U``'s nodes, of the mask keys of the
others) only for a ``U`` every node of which confirmed that same ``U`` to it, and a
node confirms one ``U`` per session. Were two nodes to reveal for ``U != U'``, every node
of ``U`` and of ``U'`` would have confirmed it, so ``U`` and ``U'`` would be disjoint;
but each has at least ``t > n / 2`` of the ``n`` nodes, so they meet. Hence every
share the server receives is for the same ``U`` and ``K``: for each node, shares of one
of its two secrets only (the seed if in ``U``, the mask key if not), and a secret needs
``t`` shares. The server rebuilds the seeds of ``U`` and the mask keys of the rest of ``K``;
each vector of ``U`` stays hidden by its pairwise masks with the rest of ``U`` (every
node of ``K`` masked with all of ``K``), which cancel only in the sum over all of
``U``; the vectors outside ``U`` stay hidden by their seeds. So the server learns the
sum over ``U`` and nothing else, with ``|U| >= t``. A confirmation names its sender and
receiver (a server that reflects a node's own confirmation back as its peer's is
caught) and the session's keys (fresh each session: no replay).

What remains trusted (docs/guarantees.md): SecAgg+'s public keys are not authenticated
(no long-term keys), so the server is trusted not to substitute them: a server that
does plays the other nodes, confirmations included. Flower seeds each mask's generator
with 32 bits of its key, hence at least :data:`MIN_NODES` nodes. And ``t`` is the
server's choice within ``(n / 2, n]``: the nodes check it against the majority rule,
not against the survivors the noise was planned for, so a server that sets it lower
than planned and leaves honest nodes out of ``U`` may unmask a sum over fewer owners
than planned (more than half the nodes still).

A refused stage is an error reply: the node leaves the round, with one log line
naming the check.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from logging import INFO, WARNING
from typing import cast

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState
from flwr.common import Code, FitRes, Status, log, ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
    Stage,
)
from flwr.compat.common import recorddict_compat as compat

from flwr_jdp.joint_dp import protocol
from flwr_jdp.privacy.skellam import MODULUS

#: The fewest nodes a secure sum may hold at any stage. Flower's SecAgg+ seeds each mask's
#: generator with 32 bits of its key: with two nodes only one pairwise mask hides a node's
#: vector once the server has unmasked, which a search of 2**32 seeds could remove; with three
#: or more, at least two masks (64 bits) remain.
MIN_NODES = 3

#: The node's record in ``context.state``: what it saw of the current SecAgg+ session.
STATE = "flwr-jdp.secure-sum"

#: flwr-jdp's own stage, between SecAgg+'s collect and unmask stages: the server names the
#: survivors (:data:`SURVIVORS`), and the node answers its confirmations of them, one per
#: other survivor (:data:`PEERS`, :data:`CONFIRMATIONS`).
CONSISTENCY = "flwr-jdp.consistency"
SURVIVORS = "flwr-jdp.survivors"
#: In the node's consistency answer: the survivors each confirmation is for. In the unmask
#: request: the survivors whose confirmations for this node the server forwards.
PEERS = "flwr-jdp.confirmation-peers"
CONFIRMATIONS = "flwr-jdp.confirmations"

#: Set while :func:`secure_sum_mod` runs the app's train handler at SecAgg+'s collect stage
#: (the reply is summed and masked there, never sent as it is); read by :func:`inside_secure_sum`.
_INSIDE: ContextVar[bool] = ContextVar("flwr_jdp_inside_secure_sum", default=False)

_LEFT = "left"  # the node refused or failed a stage: nothing but a new set-up until the next session
_ORDER = [*Stage.all()[:3], CONSISTENCY, Stage.UNMASK]
_LABEL = b"flwr-jdp secure-sum consistency v1"
_trust_logged = False


class SecureSumRefused(RuntimeError):
    """A SecAgg+ message this node will not answer; the message names the check."""


def minimum_threshold(nodes: int) -> int:
    """The smallest reconstruction threshold a node accepts for secrets shared among
    ``nodes`` nodes: more than half of them (two disjoint sets cannot both reach it) and
    at least :data:`MIN_NODES`."""
    return max(MIN_NODES, nodes // 2 + 1)


def inside_secure_sum() -> bool:
    """Whether the caller runs inside :func:`secure_sum_mod`'s collect stage: the train
    handler's reply is summed over the node's owners and masked by SecAgg+ before it
    leaves, never sent as it is. Under distributed noise an owner releases only there
    (its noise share alone is far less than the noise its ledger charges)."""
    return _INSIDE.get()


def _check_setup(rec: ConfigRecord) -> None:
    """A node takes part only in the secure sum flwr-jdp's server plans: the field and
    its encoding as :func:`secure_sum_mod` uses them, unit weights, and a reconstruction
    threshold of at least :func:`minimum_threshold` of the nodes the set-up names and at
    most their number."""
    if rec.get(Key.STAGE) != Stage.SETUP:
        return
    expected = {Key.CLIPPING_RANGE: float(MODULUS // 2), Key.TARGET_RANGE: MODULUS, Key.MOD_RANGE: MODULUS,
                Key.MAX_WEIGHT: 1.0}
    wrong = [k for k, v in expected.items() if rec.get(k) != v]
    nodes = _setup_nodes(rec)
    threshold = int(cast(int, rec.get(Key.THRESHOLD, 0)))
    if wrong or not minimum_threshold(nodes) <= threshold <= nodes:
        raise SecureSumRefused(
            f"secure aggregation set-up refused: {wrong or 'threshold'} not as flwr-jdp plans it (ranges 2**31, "
            f"unit weights, threshold {threshold} in [{minimum_threshold(nodes)}, {nodes}] for {nodes} nodes: "
            f">= {MIN_NODES} and more than half)")


def _setup_nodes(rec: ConfigRecord) -> int:
    """The nodes a set-up names: those sampled and those the secrets are shared among."""
    return max(int(cast(int, rec.get(Key.SAMPLE_NUMBER, 0))), int(cast(int, rec.get(Key.SHARE_NUMBER, 0))))


def _ids(nodes: Iterable[int]) -> bytes:
    return b"".join(int(n).to_bytes(8, "big") for n in nodes)


def confirmation(flower: SecAggPlusState, sender: int, receiver: int, survivors: Iterable[int]) -> bytes:
    """``sender``'s confirmation for ``receiver`` that the survivors are ``survivors``:
    HMAC-SHA256 under a key derived (HKDF-Expand, one block, with a label of its own)
    from the two nodes' pairwise key (Flower's ``generate_shared_key`` of one's ``sk2``
    and the other's ``pk2``, which Flower's mod keeps for the key shares it encrypts:
    symmetric, fresh each session, never revealed), over the sender, the receiver, the
    key set as this node saw it (ids and both public keys) and the sorted survivors.
    ``flower``: this node's SecAgg+ state, the sender or the receiver being this node."""
    me = flower.nid
    peer = receiver if sender == me else sender
    mac_key = hmac.new(flower.ss2_dict[peer], _LABEL + b"\x01", hashlib.sha256).digest()
    keys = hashlib.sha256()
    for nid in sorted(flower.public_keys_dict):
        pk1, pk2 = flower.public_keys_dict[nid]
        keys.update(_ids([nid, len(pk1), len(pk2)]) + pk1 + pk2)
    ordered = sorted(survivors)
    return hmac.new(mac_key, _ids([sender, receiver]) + keys.digest() + _ids([len(ordered), *ordered]),
                    hashlib.sha256).digest()


def _flower_state(context: Context) -> SecAggPlusState:
    """This node's state as Flower's SecAgg+ mod keeps it: its keys and pairwise keys."""
    return SecAggPlusState(**context.state.config_records.get(RECORD_KEY_STATE, ConfigRecord({})))


class _Session:
    """What this node saw of the current SecAgg+ session, kept in ``context.state``."""

    def __init__(self, context: Context) -> None:
        rec = context.state.config_records.get(STATE, ConfigRecord({}))
        self.stage = str(rec.get("stage", ""))
        self.nodes = int(cast(int, rec.get("nodes", 0)))
        self.threshold = int(cast(int, rec.get("threshold", 0)))
        self.keys = set(cast(list[int], rec.get("keys", [])))
        self.sources = set(cast(list[int], rec.get("sources", [])))
        self.survivors = sorted(cast(list[int], rec.get("survivors", [])))

    def save(self, context: Context) -> None:
        context.state.config_records[STATE] = ConfigRecord({
            "stage": self.stage, "nodes": self.nodes, "threshold": self.threshold,
            "keys": sorted(self.keys), "sources": sorted(self.sources),
            "survivors": self.survivors})

    def check(self, me: int, rec: ConfigRecord, context: Context) -> str:
        """Check the message of the stage ``rec`` names; remember what it shows and
        return the stage (an unmask request's confirmations are taken out of ``rec``:
        Flower's mod gets its own stage's keys only). Raises :class:`SecureSumRefused`
        naming the check."""
        stage = str(rec.get(Key.STAGE, ""))
        if stage not in _ORDER:
            raise SecureSumRefused(f"unknown SecAgg+ stage {stage!r}")
        if stage == Stage.SETUP:  # a new session: Flower draws new keys and forgets every share
            _check_setup(rec)
            self.nodes = _setup_nodes(rec)
            self.threshold = int(cast(int, rec[Key.THRESHOLD]))
            self.keys, self.sources, self.survivors = set(), set(), []
        elif self.stage not in _ORDER[:-1] or stage != _ORDER[_ORDER.index(self.stage) + 1]:
            raise SecureSumRefused(f"stage out of order: {stage} after {self.stage or 'nothing'} "
                                   "(set-up, share keys, collect, unmask, once each)")
        elif stage == Stage.SHARE_KEYS:
            keys = {int(k) for k in rec if k != Key.STAGE}
            if me not in keys:
                raise SecureSumRefused("share keys: this node's own key is not among the public keys")
            if not self.threshold <= len(keys) <= self.nodes:
                raise SecureSumRefused(f"share keys: {len(keys)} public keys, not between the threshold "
                                       f"{self.threshold} and the set-up's {self.nodes} nodes")
            self.keys = keys
        elif stage == Stage.COLLECT_MASKED_VECTORS:
            sources = cast(list[int], rec.get(Key.SOURCE_LIST, []))
            if len(set(sources)) != len(sources) or set(sources) != self.keys - {me}:
                raise SecureSumRefused(
                    "collect: key shares not from exactly every other node of the key set (each masks with all): "
                    f"from nodes this node did not share keys with (or twice): "
                    f"{sorted(set(sources) - (self.keys - {me}))[:5]}, missing: "
                    f"{sorted((self.keys - {me}) - set(sources))[:5]}")
            self.sources = set(sources)
        elif stage == CONSISTENCY:
            survivors = cast(list[int], rec.get(SURVIVORS, []))
            if len(set(survivors)) != len(survivors) or not set(survivors) <= self.keys or me not in survivors:
                raise SecureSumRefused("consistency: survivors listed twice, outside the key set, or without this "
                                       f"node: {sorted(set(survivors) - self.keys)[:5]}")
            if len(survivors) < self.threshold:
                raise SecureSumRefused(f"consistency: {len(survivors)} survivors, fewer than the threshold "
                                       f"{self.threshold}")
            self.survivors = sorted(survivors)
        else:
            active = cast(list[int], rec.get(Key.ACTIVE_NODE_ID_LIST, []))
            dead = cast(list[int], rec.get(Key.DEAD_NODE_ID_LIST, []))
            peers, macs = cast(list[int], rec.pop(PEERS, [])), cast(list[bytes], rec.pop(CONFIRMATIONS, []))
            self._check_unmask(me, active, dead)
            self._check_confirmed(_flower_state(context), active, dead, peers, macs)
        self.stage = stage
        return stage

    def _check_unmask(self, me: int, active: list[int], dead: list[int]) -> None:
        held = self.sources | {me}  # the nodes whose shares this node holds
        if len(set(active)) != len(active) or len(set(dead)) != len(dead) or set(active) & set(dead):
            raise SecureSumRefused(f"unmask: a node listed twice or both active and dead "
                                   f"({sorted(set(active) & set(dead))[:5]})")
        if me not in active:
            raise SecureSumRefused("unmask: this node, which sent its masked vector, is not listed active")
        if not set(active) | set(dead) <= self.keys:
            raise SecureSumRefused(f"unmask: nodes this node never shared keys with: "
                                   f"{sorted((set(active) | set(dead)) - self.keys)[:5]}")
        if not set(active) | set(dead) <= held:
            raise SecureSumRefused(f"unmask: nodes whose key shares this node never received: "
                                   f"{sorted((set(active) | set(dead)) - held)[:5]}")
        if len(active) < self.threshold:
            raise SecureSumRefused(f"unmask: {len(active)} active nodes, fewer than the threshold {self.threshold}")

    def confirm(self, flower: SecAggPlusState) -> RecordDict:
        """The consistency answer: this node's confirmation of the survivors for each
        other survivor (:func:`confirmation`)."""
        peers = [n for n in self.survivors if n != flower.nid]
        return RecordDict({RECORD_KEY_CONFIGS: ConfigRecord({
            PEERS: peers, CONFIRMATIONS: [confirmation(flower, flower.nid, z, self.survivors) for z in peers]})})

    def _check_confirmed(self, flower: SecAggPlusState, active: list[int], dead: list[int], peers: list[int],
                         macs: list[bytes]) -> None:
        """The unmask lists are the survivors this node confirmed (active) and the rest of
        the key set (dead), and every other survivor confirmed the same survivors to this
        node (:func:`confirmation`, checked in constant time)."""
        survivors = set(self.survivors)
        if sorted(active) != self.survivors or set(dead) != self.keys - survivors or len(dead) != len(set(dead)):
            raise SecureSumRefused("unmask: the lists are not the survivors this node confirmed (active) and the "
                                   "rest of the key set (dead)")
        me = flower.nid
        if len(set(peers)) != len(peers) or set(peers) != survivors - {me} or len(macs) != len(peers):
            raise SecureSumRefused("unmask: confirmations not from exactly every other survivor; missing: "
                                   f"{sorted(survivors - {me} - set(peers))[:5]}")
        bad = [z for z, mac in zip(peers, macs, strict=True)
               if not isinstance(mac, bytes) or not hmac.compare_digest(mac, confirmation(flower, z, me, self.survivors))]
        if bad:
            raise SecureSumRefused(f"unmask: confirmations that do not verify (forged, or for other survivors): "
                                   f"from {sorted(bad)[:5]}")


def _log_trust_once() -> None:
    global _trust_logged  # noqa: PLW0603 (one line per process)
    if not _trust_logged:
        _trust_logged = True
        log(INFO, "Secure aggregation: SecAgg+ with every survivor confirming the same survivors before any "
            "unmasking; the public keys are not authenticated, so the server is trusted not to substitute them "
            "(docs/guarantees.md)")


def secure_sum_mod(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """A ClientApp mod: messages of Flower's SecAgg+ protocol are checked against what
    this node saw (:class:`_Session`), then go through Flower's ``secaggplus_mod``; at its
    collect stage the app's train handler runs (through the app's other mods) and the sum
    of its reply's arrays (one record per owner the node hosts, each already an element
    vector modulo :data:`MODULUS`) is what SecAgg+ masks. The reply then carries nothing
    else: no per-owner count or metric. Other messages pass through; the train handler
    knows it runs here (:func:`inside_secure_sum`), and under distributed noise an owner
    releases nowhere else.
    :class:`~flwr_jdp.client.JointDPClient` puts it first on the user's ClientApp."""
    if msg.metadata.message_type != MessageType.TRAIN or RECORD_KEY_CONFIGS not in msg.content.config_records:
        return call_next(msg, context)
    session = _Session(context)
    try:
        stage = session.check(msg.metadata.dst_node_id, msg.content.config_records[RECORD_KEY_CONFIGS], context)
        confirmed = session.confirm(_flower_state(context)) if stage == CONSISTENCY else None
    except Exception as err:  # a refusal, or a message too malformed to check: the node leaves either way
        session.stage = _LEFT
        session.save(context)
        log(WARNING, "Secure aggregation refused, this node leaves the round: %s", err)
        raise
    if stage == Stage.SETUP:
        _log_trust_once()
    if confirmed is not None:  # flwr-jdp's own stage: Flower's mod never sees it
        session.save(context)
        return Message(confirmed, reply_to=msg)

    def train(inner: Message, ctx: Context) -> Message:
        token = _INSIDE.set(True)
        try:
            reply = call_next(inner, ctx)
        finally:
            _INSIDE.reset(token)
        if reply.has_error():  # refused or failed: this node drops out of the secure sum
            raise RuntimeError(reply.error.reason)
        cfg_rec = inner.content.config_records.get(protocol.CONFIG)
        wanted = len(list(cfg_rec.get(protocol.OWNERS, []))) if cfg_rec is not None else 0
        if len(reply.content.array_records) != wanted:
            # an owner of this node failed: its noise share would be missing from the sum the server
            # unmasks, which counts this node's owners as survivors, so the whole node leaves the round
            raise RuntimeError(f"{wanted - len(reply.content.array_records)} of this node's {wanted} owners "
                               "did not release; the node leaves the secure sum")
        total: list[np.ndarray] | None = None
        for record in reply.content.array_records.values():
            arrays = [np.asarray(a, dtype=np.int64) for a in record.to_numpy_ndarrays()]
            if np.any([np.any((a < 0) | (a >= MODULUS)) for a in arrays]):
                raise RuntimeError("the release is not a vector of field elements")
            total = arrays if total is None else [np.mod(t + a, MODULUS) for t, a in zip(total, arrays, strict=True)]
        if total is None:
            raise RuntimeError("the train handler replied without arrays")
        # SecAgg+ maps x in [-M/2, M/2] to x + M/2 (clipping range M/2, M levels): exact for these integers
        params = [a.astype(np.float64) - MODULUS / 2 for a in total]
        fitres = FitRes(status=Status(Code.OK, ""), parameters=ndarrays_to_parameters(params), num_examples=1,
                        metrics={})
        return Message(compat.fitres_to_recorddict(fitres, keep_input=False), reply_to=inner)

    try:
        reply = secaggplus_mod(msg, context, train)
    except Exception:
        log(WARNING, "Secure aggregation: this node leaves the round (see the error above)")
        session.stage = _LEFT
        session.save(context)
        raise
    session.save(context)
    return reply


__all__ = ["CONFIRMATIONS", "CONSISTENCY", "MIN_NODES", "PEERS", "STATE", "SURVIVORS", "SecureSumRefused",
           "confirmation", "inside_secure_sum", "minimum_threshold", "secure_sum_mod"]
