"""A deviating server against the nodes' SecAgg+ checks (distributed noise).

The attack as an independent review wrote it: the production client half (a user's
ClientApp with :class:`JointDPClient`, one owner per node, Flower's ``secaggplus_mod``
inside flwr-jdp's :func:`~flwr_jdp.joint_dp.secure_sum.secure_sum_mod`) and the
production server (:class:`JointDP` driving :class:`SecureSum`), whose messages a
:class:`DeviatingGrid` changes on their way to the nodes. The server then tries to
unmask every node's vector with every share it was sent (:func:`recover`): for each
deviation the nodes refuse or the shares do not suffice, and no owner's vector is
recovered, while the same recovery run against nodes without the check (or the honest
server's own unmasking) shows what the check prevents.
"""

from __future__ import annotations

import itertools
import sys
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
from flwr.supercore.primitives.asymmetric import (
    bytes_to_private_key,
    bytes_to_public_key,
    public_key_to_bytes,
)

import flwr_jdp.joint_dp.secure_sum as secure_sum
from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp.config import ConfigError
from flwr_jdp.privacy.skellam import MODULUS
from flwr_jdp.strategies import JointDP
from tests.test_distributed_noise import Spy, _initial, _rc, user_app

Deviate = Callable[[Message, dict], list[Message]]


class DeviatingGrid(InProcessGrid):
    """An in-process grid whose server changes its SecAgg+ messages: ``deviate(msg,
    record)`` (``record``: a copy of the message's SecAgg+ config record) returns the
    messages the node gets instead (the first one's reply goes back to the server's
    driver; the server keeps every reply). ``asked`` pairs each delivered SecAgg+
    record with the node's reply."""

    def __init__(self, nodes: int, rc: dict, deviate: Deviate | None = None) -> None:
        super().__init__(user_app(), nodes, rc, errors_as_replies=True)
        self.deviate = deviate
        self.asked: list[tuple[int, dict, Message]] = []

    def send_and_receive(self, messages, *, timeout=None):  # noqa: ANN001, ANN201
        out = []
        for msg in messages:
            rec = msg.content.config_records.get(RECORD_KEY_CONFIGS)
            if rec is None:
                out.extend(super().send_and_receive([msg], timeout=timeout))
                continue
            variants = self.deviate(msg, dict(rec)) if self.deviate else [msg]
            for i, variant in enumerate(variants):
                snapshot = dict(variant.content.config_records[RECORD_KEY_CONFIGS])  # Flower pops the stage key
                replies = list(super().send_and_receive([variant], timeout=timeout))
                self.asked.append((variant.metadata.dst_node_id, snapshot, replies[0]))
                if i == 0:
                    out.extend(replies)
        return out

    def replies(self, stage: str) -> dict[int, Message]:
        """The last reply of every node at ``stage``."""
        return {nid: reply for nid, rec, reply in self.asked if rec.get(Key.STAGE) == stage}


def unchecked(self: secure_sum._Session, me: int, rec: ConfigRecord, context: object) -> str:
    """A node without flwr-jdp's checks (for the controls): it answers the consistency
    stage the production server asks for, and passes every other message to Flower's
    mod, less the confirmations, unchecked."""
    if rec.get(Key.STAGE) == secure_sum.CONSISTENCY:
        self.survivors = sorted(rec[secure_sum.SURVIVORS])
    rec.pop(secure_sum.PEERS, None)
    rec.pop(secure_sum.CONFIRMATIONS, None)
    return str(rec.get(Key.STAGE))


def secagg_message(dst: int, **values: object) -> Message:
    return Message(RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(dict(values))}), dst_node_id=dst,
                   message_type=MessageType.TRAIN)


def unmask(dst: int, active: list[int], dead: list[int],
           confirmations: tuple[list[int], list[bytes]] = ([], [])) -> Message:
    return secagg_message(dst, **{Key.STAGE: Stage.UNMASK, Key.ACTIVE_NODE_ID_LIST: list(active),
                                  Key.DEAD_NODE_ID_LIST: list(dead), secure_sum.PEERS: confirmations[0],
                                  secure_sum.CONFIRMATIONS: confirmations[1]})


def confirmations_for(grid: DeviatingGrid, dst: int, senders: list[int]) -> tuple[list[int], list[bytes]]:
    """The confirmations for ``dst`` the server holds from ``senders`` (the nodes'
    consistency answers)."""
    peers, macs = [], []
    for src, reply in sorted(grid.replies(secure_sum.CONSISTENCY).items()):
        answer = reply.content.config_records[RECORD_KEY_CONFIGS] if not reply.has_error() else {}
        for peer, mac in zip(answer.get(secure_sum.PEERS, []), answer.get(secure_sum.CONFIRMATIONS, []), strict=True):
            if peer == dst and src in senders:
                peers.append(src)
                macs.append(mac)
    return peers, macs


def unmask_views(grid: DeviatingGrid, views: dict[int, list[int]]) -> None:
    """The server asks each node to unmask its own view: active ``views[node]``, dead the
    rest, with the confirmations for it that it holds from that view's nodes."""
    for dst, active in views.items():
        dead = [n for n in views if n not in active]
        grid.send_and_receive([unmask(dst, active, dead, confirmations_for(grid, dst, active))])


def at(stage: str, change: Callable[[Message, dict], list[Message]]) -> Deviate:
    """Change only the messages of ``stage``."""
    return lambda msg, rec: change(msg, rec) if rec.get(Key.STAGE) == stage else [msg]


def run(nodes: int, deviate: Deviate | None, tmp_path, **over: object) -> tuple[JointDP, DeviatingGrid]:  # noqa: ANN001
    """One round of the production strategy over ``nodes`` nodes (one owner each)."""
    rc = _rc(nodes, **{"results-dir": str(tmp_path), "num-rounds": 1, "max-skipped-rounds": 1, **over})
    grid = DeviatingGrid(nodes, rc, deviate)
    strategy = JointDP.from_run_config(rc, node_settle_s=0.0)
    try:
        strategy.start(grid=grid, initial_arrays=_initial())
    except Exception:  # noqa: BLE001 (a round stopped, or the deviating driver's own unmasking failed)
        pass
    return strategy, grid


def recover(grid: DeviatingGrid, size: int = 1) -> dict[tuple[int, ...], np.ndarray]:
    """The server's best try at the sum of the vectors of every ``size`` nodes (each
    node's vector for ``size`` 1) from what it holds: their masked vectors, minus each
    one's self mask rebuilt from the shares of its seed it was sent, minus each pairwise
    mask with a node outside the set (those within cancel in the sum), rebuilt from
    either end's mask key (its shares) and the other end's public key. A set one of whose
    seeds or such pairwise keys cannot be rebuilt is not recovered."""
    pk1 = {n: r.content.config_records[RECORD_KEY_CONFIGS][Key.PUBLIC_KEY_1]
           for n, r in grid.replies(Stage.SETUP).items() if not r.has_error()}
    masked = {n: [bytes_to_ndarray(b) for b in r.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]]
              for n, r in grid.replies(Stage.COLLECT_MASKED_VECTORS).items() if not r.has_error()}
    sources = {n: rec[Key.SOURCE_LIST] for n, rec, _ in grid.asked if rec.get(Key.STAGE) == Stage.COLLECT_MASKED_VECTORS}
    seed_shares: dict[int, set[bytes]] = defaultdict(set)
    key_shares: dict[int, set[bytes]] = defaultdict(set)
    for _, rec, reply in grid.asked:
        if rec.get(Key.STAGE) != Stage.UNMASK or reply.has_error():
            continue
        answer = reply.content.config_records[RECORD_KEY_CONFIGS]
        active = len(rec[Key.ACTIVE_NODE_ID_LIST])  # Flower answers the active nodes' seeds, then the dead's keys
        for i, (owner, share) in enumerate(zip(answer[Key.NODE_ID_LIST], answer[Key.SHARE_LIST], strict=True)):
            (seed_shares if i < active else key_shares)[owner].add(share)

    def rebuilt(shares: set[bytes]) -> bytes | None:
        try:
            return combine_shares(sorted(shares)) if shares else None
        except Exception:  # noqa: BLE001 (too few or mixed shares)
            return None

    def checked_key(nid: int) -> bytes | None:  # a mask key is the right one if it matches the node's public key
        key = rebuilt(key_shares[nid])
        try:
            return key if key and public_key_to_bytes(bytes_to_private_key(key).public_key()) == pk1.get(nid) else None
        except Exception:  # noqa: BLE001 (not a key)
            return None

    keys = {n: k for n in list(key_shares) if (k := checked_key(n)) is not None}

    def unmasked(nid: int, within: tuple[int, ...]) -> list[np.ndarray] | None:
        vec, outside = masked[nid], [o for o in sources[nid] if o not in within]
        seed = rebuilt(seed_shares[nid])
        if seed is None or any(nid not in keys and other not in keys for other in outside):
            return None
        shapes = [a.shape for a in vec]
        try:  # a seed rebuilt from too few shares is garbage, which Flower's generator may refuse
            x = [a.astype(np.int64) - m for a, m in zip(vec, pseudo_rand_gen(seed, MODULUS, shapes), strict=True)]
            for other in outside:  # the pairwise key from either end's rebuilt mask key
                mine, theirs = (nid, other) if nid in keys else (other, nid)
                shared = generate_shared_key(bytes_to_private_key(keys[mine]), bytes_to_public_key(pk1[theirs]))
                mask = pseudo_rand_gen(shared, MODULUS, shapes)
                x = [a - m if nid > other else a + m for a, m in zip(x, mask, strict=True)]
        except Exception:  # noqa: BLE001 (no usable seed)
            return None
        return x

    out = {}
    for group in itertools.combinations(sorted(masked), size):
        parts = [unmasked(nid, group) for nid in group]
        if all(p is not None for p in parts):  # the first entry is SecAgg+'s weight
            out[group] = np.concatenate([np.mod(sum(a), MODULUS).ravel() for a in zip(*parts, strict=True)][1:])
    return out


def owners_vectors(spy: Spy) -> list[np.ndarray]:
    return [np.concatenate([a.ravel() for a in v["field"]]) for v in spy.vectors]


def recovered_owners(grid: DeviatingGrid, spy: Spy, size: int = 1) -> int:
    """How many sums of ``size`` owners' vectors (each owner's vector for 1) the server
    recovered, bit for bit."""
    tries = list(recover(grid, size).values())
    sums = [sum(group) % MODULUS for group in itertools.combinations(owners_vectors(spy), size)]
    return sum(any(np.array_equal(t, own) for t in tries) for own in sums)


def refusals(grid: DeviatingGrid, stage: str) -> dict[int, str]:
    return {n: r.error.reason for n, r in grid.replies(stage).items() if r.has_error()}


# ------------------------------------------------------------------ the review's attack
def overlap(msg: Message, rec: dict) -> list[Message]:
    """Every survivor listed both active and dead."""
    both = list(rec[Key.ACTIVE_NODE_ID_LIST])
    return [unmask(msg.metadata.dst_node_id, both, both)]


def test_the_honest_server_unmasks_the_exact_sum_and_no_vector(tmp_path, monkeypatch):
    spy = Spy(monkeypatch)
    strategy, grid = run(3, None, tmp_path)
    assert strategy.status == "completed"
    total = np.concatenate([a.ravel() for a in strategy._secure.total[1:]])
    assert np.array_equal(total, sum(owners_vectors(spy)) % MODULUS)
    assert recovered_owners(grid, spy) == 0


def test_active_and_dead_overlap_is_refused_and_unmasks_nothing(tmp_path, monkeypatch):
    """The review's attack (3 nodes, only the unmask request changed). Against Flower's
    own checks it recovers each owner's vector bit for bit; each node refuses it."""
    spy = Spy(monkeypatch)
    with monkeypatch.context() as m:  # the nodes without flwr-jdp's unmask checks: the review's result
        m.setattr(secure_sum._Session, "_check_unmask", lambda *a: None)
        m.setattr(secure_sum._Session, "_check_confirmed", lambda *a: None)
        _, grid = run(3, at(Stage.UNMASK, overlap), tmp_path / "unchecked")
    assert recovered_owners(grid, spy) == 3
    spy.vectors.clear()
    strategy, grid = run(3, at(Stage.UNMASK, overlap), tmp_path)
    reasons = refusals(grid, Stage.UNMASK)
    assert len(reasons) == 3 and all("both active and dead" in r for r in reasons.values()), reasons
    assert strategy._secure.total is None and recovered_owners(grid, spy) == 0


@pytest.mark.parametrize("lists,check", [
    (lambda alive, me: (alive, [4242]), "never shared keys"),
    (lambda alive, me: (alive + [4242], []), "never shared keys"),
    (lambda alive, me: ([n for n in alive if n != me], [me]), "not listed active"),
])
def test_an_unmask_list_against_what_the_node_saw_is_refused(tmp_path, monkeypatch, lists, check):
    """A dead or active node the node never shared keys with, or the node itself listed
    dead: every node refuses and the server gets no share."""
    spy = Spy(monkeypatch)

    def change(msg: Message, rec: dict) -> list[Message]:
        active, dead = lists(sorted(rec[Key.ACTIVE_NODE_ID_LIST]), msg.metadata.dst_node_id)
        return [unmask(msg.metadata.dst_node_id, active, dead)]

    strategy, grid = run(3, at(Stage.UNMASK, change), tmp_path)
    reasons = refusals(grid, Stage.UNMASK)
    assert len(reasons) == 3 and all(check in r for r in reasons.values()), reasons
    assert strategy._secure.total is None and recovered_owners(grid, spy) == 0


def without_own_key(msg: Message, rec: dict) -> list[Message]:
    return [secagg_message(msg.metadata.dst_node_id,
                           **{k: v for k, v in rec.items() if k != str(msg.metadata.dst_node_id)})]


def from_a_stranger(msg: Message, rec: dict) -> list[Message]:
    return [secagg_message(msg.metadata.dst_node_id, **{**rec, Key.SOURCE_LIST: [*rec[Key.SOURCE_LIST], 4242],
                                                         Key.CIPHERTEXT_LIST: [*rec[Key.CIPHERTEXT_LIST], b"x"]})]


@pytest.mark.parametrize("stage,change,check", [
    (Stage.SHARE_KEYS, without_own_key, "own key is not among"),
    (Stage.COLLECT_MASKED_VECTORS, from_a_stranger, "did not share keys with"),
])
def test_keys_or_share_sources_against_what_the_node_saw_are_refused(tmp_path, monkeypatch, stage, change, check):
    """A key set without the node's own key, or key shares from a node it never shared
    keys with: every node refuses before masking anything."""
    spy = Spy(monkeypatch)
    strategy, grid = run(3, at(stage, change), tmp_path)
    reasons = refusals(grid, stage)
    assert len(reasons) == 3 and all(check in r for r in reasons.values()), reasons
    assert not grid.replies(Stage.UNMASK) and strategy._secure.total is None and recovered_owners(grid, spy) == 0


def test_a_second_unmask_request_is_refused(tmp_path, monkeypatch):
    """Five nodes, threshold 3. After each node answers the honest request (all five
    active), the server asks again with nodes 1003 and 1004 dead: answered, it would give
    their mask keys too, and with their seeds from the first answers, their vectors. The
    node answers one unmask request per session."""
    spy = Spy(monkeypatch)

    def twice(msg: Message, rec: dict) -> list[Message]:
        alive = sorted(rec[Key.ACTIVE_NODE_ID_LIST])
        return [msg, unmask(msg.metadata.dst_node_id, alive[:3], alive[3:])]

    with monkeypatch.context() as m:  # without the check (and Flower's stage order): two vectors recovered
        m.setattr(secure_sum._Session, "check", unchecked)
        m.setattr(sys.modules["flwr.client.mod.secure_aggregation.secaggplus_mod"], "check_stage", lambda *a: None)
        _, grid = run(5, at(Stage.UNMASK, twice), tmp_path / "unchecked", **{"dropout-tolerance": 0.4})
    assert recovered_owners(grid, spy) == 2
    spy.vectors.clear()
    strategy, grid = run(5, at(Stage.UNMASK, twice), tmp_path, **{"dropout-tolerance": 0.4})
    assert strategy.status == "completed"  # the first, honest request was answered: the sum was released
    seconds = [reply for _, rec, reply in grid.asked if rec.get(Key.STAGE) == Stage.UNMASK][1::2]
    assert len(seconds) == 5 and all("out of order" in r.error.reason for r in seconds)
    assert recovered_owners(grid, spy) == 0


def stories(dead_for: set[int], victim: int) -> Deviate:
    """Nodes in ``dead_for`` hear ``victim`` dead; the others hear it active."""
    def change(msg: Message, rec: dict) -> list[Message]:
        alive = sorted(rec[Key.ACTIVE_NODE_ID_LIST])
        if msg.metadata.dst_node_id in dead_for:
            return [unmask(msg.metadata.dst_node_id, [n for n in alive if n != victim], [victim])]
        return [msg]
    return at(Stage.UNMASK, change)


@pytest.mark.parametrize("dead_for", [{1001, 1002}, {1001, 1002, 1003}])
def test_different_stories_cannot_gather_both_secrets_of_a_node(tmp_path, monkeypatch, dead_for):
    """Five nodes, threshold 3 (> 5 / 2): some nodes hear node 1000 dead, the others
    (1000 itself among them) hear it active. Each story passes every node's checks, but
    the five answers hold at most 5 < 2 x 3 shares of node 1000's two secrets: the
    server rebuilds one of them, never both, and no vector. (The majority rule alone:
    the nodes here skip the check that the lists are the ones every survivor
    confirmed, which refuses any dead node the server's word alone names.)"""
    spy = Spy(monkeypatch)
    monkeypatch.setattr(secure_sum._Session, "_check_confirmed", lambda *a: None)
    _, grid = run(5, stories(dead_for, 1000), tmp_path, **{"dropout-tolerance": 0.4})
    assert not refusals(grid, Stage.UNMASK)
    assert recovered_owners(grid, spy) == 0


def test_different_stories_recover_a_vector_below_a_majority_threshold(tmp_path, monkeypatch):
    """The same stories with six nodes and a threshold of 3 (= 6 / 2) set up by the
    server, against nodes without the majority rule: three hear node 1000 dead, three
    active, and the server rebuilds both its secrets and its vector. The rule refuses
    that set-up (next test)."""
    spy = Spy(monkeypatch)
    monkeypatch.setattr(secure_sum, "minimum_threshold", lambda nodes: secure_sum.MIN_NODES)
    monkeypatch.setattr(secure_sum._Session, "_check_confirmed", lambda *a: None)

    def low(msg: Message, rec: dict) -> list[Message]:
        if rec.get(Key.STAGE) == Stage.SETUP:
            return [secagg_message(msg.metadata.dst_node_id, **{**rec, Key.THRESHOLD: 3})]
        return stories({1001, 1002, 1003}, 1000)(msg, rec)

    _, grid = run(6, low, tmp_path, **{"dropout-tolerance": 0.2})
    assert recovered_owners(grid, spy) == 1


@pytest.mark.parametrize("nodes,threshold", [(6, 3), (4, 2), (5, 6)])
def test_a_setup_threshold_of_at_most_half_the_nodes_is_refused(tmp_path, monkeypatch, nodes, threshold):
    """Every node refuses a set-up whose threshold is not more than half the nodes (or
    exceeds them): it sends no public key, so nothing is masked or unmasked."""
    spy = Spy(monkeypatch)

    def low(msg: Message, rec: dict) -> list[Message]:
        return [secagg_message(msg.metadata.dst_node_id, **{**rec, Key.THRESHOLD: threshold})]

    strategy, grid = run(nodes, at(Stage.SETUP, low), tmp_path)
    reasons = refusals(grid, Stage.SETUP)
    assert len(reasons) == nodes and all("threshold" in r for r in reasons.values()), reasons
    assert not spy.vectors and strategy._secure.total is None


def test_a_dropout_tolerance_the_threshold_cannot_meet_fails_at_startup(tmp_path):
    """Three nodes need all three (threshold > 3 / 2, >= 3): a tolerance that lets one
    drop is refused before any release, naming the key."""
    rc = _rc(3, **{"results-dir": str(tmp_path), "dropout-tolerance": 0.4})
    grid = DeviatingGrid(3, rc)
    with pytest.raises(ConfigError, match=r"jdp.dropout-tolerance.*below 0.333"):
        JointDP.from_run_config(rc, node_settle_s=0.0).start(grid=grid, initial_arrays=_initial())


def test_the_honest_server_sets_up_a_majority_threshold():
    """Asked for a threshold of 1, the server's driver sets up the nodes' rule: more
    than half the nodes, at least 3."""
    from flwr_jdp.strategies.joint_dp.secagg import SecureSum

    for nodes in (3, 4, 5, 6):
        grid = DeviatingGrid(nodes, _rc(nodes))
        SecureSum(MODULUS, None).run(grid, {n: RecordDict() for n in grid.contexts}, 1, "1", lambda s: None)
        thresholds = {rec[Key.THRESHOLD] for _, rec, _ in grid.asked if rec.get(Key.STAGE) == Stage.SETUP}
        assert thresholds == {max(3, nodes // 2 + 1)} and not refusals(grid, Stage.SETUP)


@pytest.mark.parametrize("stage,instead", [
    (Stage.SHARE_KEYS, lambda dst: secagg_message(dst, **{Key.STAGE: Stage.COLLECT_MASKED_VECTORS,
                                                          Key.CIPHERTEXT_LIST: [], Key.SOURCE_LIST: []})),
    (Stage.COLLECT_MASKED_VECTORS, lambda dst: unmask(dst, [1000, 1001, 1002], [])),
    (Stage.SHARE_KEYS, lambda dst: unmask(dst, [1000, 1001, 1002], [])),
])
def test_a_stage_out_of_order_is_refused(tmp_path, monkeypatch, stage, instead):
    """A stage skipped: every node refuses it and sends no vector."""
    spy = Spy(monkeypatch)
    strategy, grid = run(3, at(stage, lambda msg, rec: [instead(msg.metadata.dst_node_id)]), tmp_path)
    reasons = [reply.error.reason for _, rec, reply in grid.asked if reply.has_error()]
    assert len(reasons) == 3 and all("out of order" in r for r in reasons), reasons
    assert not spy.vectors and strategy._secure.total is None


def tailored_views(msg: Message, rec: dict) -> list[Message]:
    """The attack of tailored views (five nodes, threshold 3): the server forwards node
    1000 the key shares of 1001 and 1002 only (so that 1000 would mask with those two),
    and tells each node its own dead list: 1001 hears 1002 dead, 1002 hears 1001 dead,
    1003 and 1004 hear both dead. Answered, the answers would hold 3 shares of 1000's
    seed and of 1001's and 1002's mask keys: 1000's vector."""
    ids = [1000, 1001, 1002, 1003, 1004]
    dead = {1000: [], 1001: [1002], 1002: [1001], 1003: [1001, 1002], 1004: [1001, 1002]}
    dst = msg.metadata.dst_node_id
    if rec.get(Key.STAGE) == Stage.COLLECT_MASKED_VECTORS and dst == 1000:
        keep = [i for i, src in enumerate(rec[Key.SOURCE_LIST]) if src in (1001, 1002)]
        msg.content.config_records[RECORD_KEY_CONFIGS] = ConfigRecord({
            Key.STAGE: rec[Key.STAGE], Key.SOURCE_LIST: [rec[Key.SOURCE_LIST][i] for i in keep],
            Key.CIPHERTEXT_LIST: [rec[Key.CIPHERTEXT_LIST][i] for i in keep]})
    if rec.get(Key.STAGE) == Stage.UNMASK:
        held = [1000, 1001, 1002] if dst == 1000 else ids
        return [unmask(dst, [n for n in held if n not in dead[dst]], dead[dst])]
    return [msg]


def test_tailored_views_from_five_nodes_are_refused(tmp_path, monkeypatch):
    """Against nodes without flwr-jdp's checks (Flower's own let a node mask with fewer
    peers than the key set, and reveal a dead node's mask key on the server's word) the
    attack recovers node 1000's vector. Each node masks with every node of the key set and
    reveals no mask key without the consistency round: node 1000 refuses the collect
    stage, the others the unmask requests, and nothing is recovered."""
    spy = Spy(monkeypatch)
    with monkeypatch.context() as m:
        m.setattr(secure_sum._Session, "check", unchecked)
        _, grid = run(5, tailored_views, tmp_path / "unchecked", **{"dropout-tolerance": 0.4})
    assert not refusals(grid, Stage.UNMASK) and recovered_owners(grid, spy) == 1
    spy.vectors.clear()
    strategy, grid = run(5, tailored_views, tmp_path, **{"dropout-tolerance": 0.4})
    assert "missing: [1003, 1004]" in refusals(grid, Stage.COLLECT_MASKED_VECTORS)[1000]
    assert strategy._secure.total is None and recovered_owners(grid, spy) == 0


# ------------------------------------------------------------------ the consistency round
def silent(stage: str, node: int) -> Deviate:
    return at(stage, lambda msg, rec: [] if msg.metadata.dst_node_id == node else [msg])


def test_a_node_dropping_after_sharing_keys_leaves_the_exact_sum_of_the_survivors(tmp_path, monkeypatch):
    """Dropout tolerance, what the consistency round is for: five nodes, threshold 3, node
    1002 silent after sharing its keys. The four survivors confirm the same survivors,
    reveal 1002's mask key and their seeds, and the server unmasks exactly their sum
    (the same recovery finds it from the answers), and no vector nor a sum of fewer."""
    spy = Spy(monkeypatch)
    strategy, grid = run(5, silent(Stage.COLLECT_MASKED_VECTORS, 1002), tmp_path, **{"dropout-tolerance": 0.4})
    assert strategy.status == "completed" and strategy._secure.survivors == [1000, 1001, 1003, 1004]
    assert len(spy.vectors) == 4  # 1002 never got its train instruction
    total = np.concatenate([a.ravel() for a in strategy._secure.total[1:]])
    assert np.array_equal(total, sum(owners_vectors(spy)) % MODULUS)
    assert recovered_owners(grid, spy, 4) == 1
    assert [recovered_owners(grid, spy, k) for k in (1, 2, 3)] == [0, 0, 0]


#: Each node's survivors (five nodes, threshold 3): unmasked, 1001, 1003 and 1004 would
#: reveal 1002's mask key, 1000, 1002 and 1004 1003's, four nodes 1004's, and all five the
#: seeds of 1000 and 1001: the sum of those two vectors alone.
TAILORED = {1000: [1000, 1001, 1002], 1001: [1000, 1001, 1003], 1002: [1000, 1001, 1002],
            1003: [1000, 1001, 1003], 1004: [1000, 1001, 1004]}


def tailored_survivors(msg: Message, rec: dict) -> list[Message]:
    dst = msg.metadata.dst_node_id
    return [secagg_message(dst, **{**rec, secure_sum.SURVIVORS: TAILORED[dst]})]


def test_tailored_survivor_lists_are_refused_and_no_partial_sum_is_recovered(tmp_path, monkeypatch):
    """Five nodes, every masked vector in; the server tells each node its own survivors
    (:data:`TAILORED`, each list of at least 3 with the node in it) and asks each to
    unmask its list, forwarding the confirmations it holds from that list's nodes. Nodes
    that skip the confirmations' check answer, and the server recovers the sum of 1000's
    and 1001's vectors alone (2 of 5 nodes: the noise of two owners, below the plan's).
    Each node refuses (a survivor of its list confirmed another list, or did not confirm
    to it at all), and no vector nor
    any sum of fewer than all five nodes is recovered."""
    spy = Spy(monkeypatch)
    with monkeypatch.context() as m:
        m.setattr(secure_sum._Session, "_check_confirmed", lambda *a: None)
        _, grid = run(5, at(secure_sum.CONSISTENCY, tailored_survivors), tmp_path / "unchecked",
                      **{"dropout-tolerance": 0.4})
        unmask_views(grid, TAILORED)
    assert not refusals(grid, Stage.UNMASK) and recovered_owners(grid, spy, 2) == 1
    spy.vectors.clear()
    strategy, grid = run(5, at(secure_sum.CONSISTENCY, tailored_survivors), tmp_path, **{"dropout-tolerance": 0.4})
    assert "did not confirm" in strategy._secure.stopped  # the honest driver stops: the answers are for other lists
    unmask_views(grid, TAILORED)
    reasons = refusals(grid, Stage.UNMASK)
    assert len(reasons) == 5 and all("do not verify" in r or "missing" in r for r in reasons.values()), reasons
    assert [recovered_owners(grid, spy, k) for k in (1, 2, 3, 4)] == [0, 0, 0, 0]


def hold_unmask(msg: Message, rec: dict) -> list[Message]:
    return [] if rec.get(Key.STAGE) == Stage.UNMASK else [msg]


@pytest.mark.parametrize("tamper,check", [
    (lambda peers, macs, own: (peers, macs), None),
    (lambda peers, macs, own: (peers[1:], macs[1:]), "missing: [1001]"),
    (lambda peers, macs, own: (peers, [bytes([macs[0][0] ^ 1]) + macs[0][1:], *macs[1:]]), "do not verify"),
    (lambda peers, macs, own: (peers, [own[peers[0]], *macs[1:]]), "do not verify"),
])
def test_a_missing_forged_or_reflected_confirmation_is_refused(tmp_path, monkeypatch, tamper, check):
    """Five nodes, all in, the unmask requests held back; node 1000 is then asked with
    its confirmations as forwarded (answered), one missing, one altered, or one replaced
    by the confirmation 1000 itself sent that peer (a reflection: were the sender and
    receiver not authenticated, the two would be equal). 1000 refuses each change."""
    spy = Spy(monkeypatch)
    _, grid = run(5, hold_unmask, tmp_path, **{"dropout-tolerance": 0.4})
    ids = [1000, 1001, 1002, 1003, 1004]
    mine = grid.replies(secure_sum.CONSISTENCY)[1000].content.config_records[RECORD_KEY_CONFIGS]
    own = dict(zip(mine[secure_sum.PEERS], mine[secure_sum.CONFIRMATIONS], strict=True))
    grid.deviate = None
    grid.send_and_receive([unmask(1000, ids, [], tamper(*confirmations_for(grid, 1000, ids), own))])
    reason = refusals(grid, Stage.UNMASK).get(1000)
    assert (reason is None) if check is None else (check in str(reason)), reason
    assert recovered_owners(grid, spy) == 0


def test_two_disjoint_consistent_lists_recover_every_vector_below_a_majority_threshold(tmp_path, monkeypatch):
    """Why the consistency round needs the majority threshold: six nodes and a threshold
    of 3 (= 6 / 2) against nodes without the majority rule. The server tells 1000-1002
    the survivors are those three, and 1003-1005 the other three: each list is confirmed
    by all its nodes, every check passes, and the answers hold both secrets of every
    node. With the rule (t > n / 2) two confirmed lists share a node, which confirms
    once: one list in a session."""
    spy = Spy(monkeypatch)
    monkeypatch.setattr(secure_sum, "minimum_threshold", lambda nodes: secure_sum.MIN_NODES)
    halves = {n: [1000, 1001, 1002] if n < 1003 else [1003, 1004, 1005] for n in range(1000, 1006)}

    def split(msg: Message, rec: dict) -> list[Message]:
        dst = msg.metadata.dst_node_id
        if rec.get(Key.STAGE) == Stage.SETUP:
            return [secagg_message(dst, **{**rec, Key.THRESHOLD: 3})]
        if rec.get(Key.STAGE) == secure_sum.CONSISTENCY:
            return [secagg_message(dst, **{**rec, secure_sum.SURVIVORS: halves[dst]})]
        return [msg]

    _, grid = run(6, split, tmp_path, **{"dropout-tolerance": 0.2})
    unmask_views(grid, halves)
    assert not refusals(grid, Stage.UNMASK) and recovered_owners(grid, spy) == 6
