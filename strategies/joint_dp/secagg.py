"""The server's side of Flower's SecAgg+ protocol, driven from JointDP's round.

Flower ships the protocol's client half (``flwr.client.mod.secaggplus_mod``) and a
server workflow (``SecAggPlusWorkflow``) written for the legacy ``Strategy`` API; a
Message-API strategy cannot hand it its round. :class:`SecureSum` runs the same four
stages with the same messages (``secaggplus`` config records, the stage keys of
``flwr.common.secure_aggregation.secaggplus_constants``) and Flower's own primitives
(Shamir reconstruction, key agreement, the masks' generator); no cryptography is
written here. It differs from Flower's workflow where JointDP needs it:

- every node is every other node's neighbour (SecAgg's full graph), and the
  reconstruction threshold is the fewest survivors the round accepts, never below 3
  (:data:`~flwr_jdp.joint_dp.secure_sum.MIN_NODES`: Flower seeds each mask's
  generator with 32 bits of its key, so with two survivors one unknown mask would
  hide a node's vector) and always more than half the nodes
  (:func:`~flwr_jdp.joint_dp.secure_sum.minimum_threshold`, the rule every node
  checks: no two disjoint sets of nodes both reach it);
- the unmasked result is the sum modulo ``M`` of the nodes' integer vectors, returned
  as such (JointDP decodes it; Flower's workflow dequantises to floats and divides
  by the total weight);
- every node masks with every node of the key set (the nodes refuse a collect stage
  without key shares from all of them), so a node leaving while keys are shared stops
  the round before anything is masked;
- between collect and unmask, flwr-jdp's consistency stage
  (:data:`~flwr_jdp.joint_dp.secure_sum.CONSISTENCY`): each survivor confirms the
  survivor list to every other, and the unmask request forwards each node the
  confirmations addressed to it (the nodes answer only when every other survivor
  confirmed the same list; the argument is in
  :mod:`flwr_jdp.joint_dp.secure_sum`); a survivor that does not confirm stops the
  round before unmasking;
- a dropped node's pairwise masks are removed only with the nodes whose vectors are
  in the sum;
- ``proceed(survivors)`` is asked after the masked vectors arrive: if it says no (too
  few owners survived for the noise the round was planned with) the server stops
  before the unmask stage and never learns the sum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from logging import WARNING
from typing import cast

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common import bytes_to_ndarray, log
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.common.secure_aggregation.ndarrays_arithmetic import (
    parameters_addition,
    parameters_mod,
    parameters_subtraction,
)
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
from flwr.serverapp import Grid
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

from flwr_jdp.joint_dp.secure_sum import (
    CONFIRMATIONS,
    CONSISTENCY,
    MIN_NODES,
    PEERS,
    SURVIVORS,
    minimum_threshold,
)


@dataclass
class SecureSumResult:
    """What one secure sum gave the server: the sum modulo ``modulus`` of the
    surviving nodes' vectors (None if the round stopped before unmasking), the
    surviving nodes, and why each other node left."""

    total: list[np.ndarray] | None
    survivors: list[int]
    dropped: dict[int, str] = field(default_factory=dict)
    stopped: str = ""


class SecureSum:
    """One SecAgg+ exchange over ``nodes`` (``contents[node]``: the node's train
    instruction, sent with the collect stage)."""

    def __init__(self, modulus: int, timeout: float | None) -> None:
        if modulus & (modulus - 1) or modulus > 2**31:
            raise ValueError("the modulus must be a power of two <= 2**31 (SecAgg+ quantises to int32)")
        self.modulus = modulus
        self.timeout = timeout

    def _exchange(self, grid: Grid, records: dict[int, RecordDict], group: str,
                  dropped: dict[int, str], stage: str) -> dict[int, ConfigRecord]:
        msgs = [Message(content, dst_node_id=nid, message_type=MessageType.TRAIN, group_id=group)
                for nid, content in records.items()]
        replies = {}
        for reply in grid.send_and_receive(msgs, timeout=self.timeout):
            nid = reply.metadata.src_node_id
            if reply.has_error():
                dropped[nid] = f"{stage}: {reply.error.reason}"
            elif RECORD_KEY_CONFIGS not in reply.content.config_records:
                dropped[nid] = f"{stage}: reply without the '{RECORD_KEY_CONFIGS}' record"
            else:
                replies[nid] = reply.content.config_records[RECORD_KEY_CONFIGS]
        for nid in records:
            if nid not in replies and nid not in dropped:
                dropped[nid] = f"{stage}: no reply within the timeout"
        return replies

    def _confirm(self, grid: Grid, survivors: list[int], group: str,
                 dropped: dict[int, str]) -> dict[int, tuple[list[int], list[bytes]]] | None:
        """flwr-jdp's consistency stage: every survivor confirms the survivors to every
        other; returns, for each survivor, the confirmations addressed to it (None if a
        survivor did not answer, or answered without a confirmation for each other)."""
        def consistency() -> RecordDict:
            return RecordDict({RECORD_KEY_CONFIGS: ConfigRecord({Key.STAGE: CONSISTENCY, SURVIVORS: survivors})})

        answers = self._exchange(grid, {n: consistency() for n in survivors}, group, dropped, "consistency")
        forward: dict[int, tuple[list[int], list[bytes]]] = {n: ([], []) for n in survivors}
        for src, rec in answers.items():
            peers, macs = cast(list[int], rec.get(PEERS, [])), cast(list[bytes], rec.get(CONFIRMATIONS, []))
            if sorted(peers) != [n for n in survivors if n != src] or len(macs) != len(peers):
                dropped[src] = "consistency: not one confirmation for each other survivor"
                continue
            for dst, mac in zip(peers, macs, strict=True):
                forward[dst][0].append(src)
                forward[dst][1].append(mac)
        return forward if all(n in answers and n not in dropped for n in survivors) else None

    def run(self, grid: Grid, contents: dict[int, RecordDict], threshold: int, group: str,
            proceed: Callable[[list[int]], str | None]) -> SecureSumResult:
        """The four stages, and the consistency stage before unmasking. ``threshold``: nodes whose shares rebuild a secret (and the
        fewest nodes that may remain at any stage); ``proceed(survivors)`` returns a
        reason to stop before unmasking, or None."""
        nodes = sorted(contents)
        dropped: dict[int, str] = {}
        if len(nodes) < MIN_NODES:
            return SecureSumResult(None, [], {}, f"secure aggregation needs at least {MIN_NODES} nodes")
        threshold = max(minimum_threshold(len(nodes)), min(int(threshold), len(nodes)))
        m = self.modulus
        def setup() -> RecordDict:  # one record per message: the client mod pops its stage key
            return RecordDict({RECORD_KEY_CONFIGS: ConfigRecord({
                Key.STAGE: Stage.SETUP, Key.SAMPLE_NUMBER: len(nodes), Key.SHARE_NUMBER: len(nodes),
                Key.THRESHOLD: threshold, Key.CLIPPING_RANGE: float(m // 2), Key.TARGET_RANGE: int(m),
                Key.MOD_RANGE: int(m), Key.MAX_WEIGHT: 1.0})})

        keys = self._exchange(grid, {n: setup() for n in nodes}, group, dropped, "setup")
        public = {n: [cast(bytes, rec[Key.PUBLIC_KEY_1]), cast(bytes, rec[Key.PUBLIC_KEY_2])]
                  for n, rec in keys.items()}
        if len(public) < threshold:
            return SecureSumResult(None, [], dropped, f"{len(public)} nodes after the setup < {threshold}")

        def share_keys(nid: int) -> RecordDict:
            rec = ConfigRecord({str(n): public[n] for n in public})
            rec[Key.STAGE] = Stage.SHARE_KEYS
            return RecordDict({RECORD_KEY_CONFIGS: rec})

        shares = self._exchange(grid, {n: share_keys(n) for n in public}, group, dropped, "share keys")
        sampled = sorted(shares)  # their key shares went out: their pairwise masks are in use
        if len(sampled) < len(public):  # each node masks with every node of the key set, or refuses
            return SecureSumResult(None, [], dropped, f"{len(public) - len(sampled)} node(s) left while sharing "
                                   "keys (each node masks with every node of the key set); nothing masked")
        forward: dict[int, tuple[list[int], list[bytes]]] = {n: ([], []) for n in sampled}
        for src in sampled:
            rec = shares[src]
            for dst, ct in zip(cast(list[int], rec[Key.DESTINATION_LIST]),
                               cast(list[bytes], rec[Key.CIPHERTEXT_LIST]), strict=True):
                if dst in forward:
                    forward[dst][0].append(src)
                    forward[dst][1].append(ct)

        def collect(nid: int) -> RecordDict:
            content = RecordDict(dict(contents[nid].items()))
            content[RECORD_KEY_CONFIGS] = ConfigRecord({
                Key.STAGE: Stage.COLLECT_MASKED_VECTORS, Key.CIPHERTEXT_LIST: forward[nid][1],
                Key.SOURCE_LIST: forward[nid][0]})
            return content

        masked = self._exchange(grid, {n: collect(n) for n in sampled}, group, dropped, "collect")
        total: list[np.ndarray] | None = None
        for nid in sorted(masked):
            vec = [bytes_to_ndarray(b) for b in cast(list[bytes], masked[nid][Key.MASKED_PARAMETERS])]
            total = vec if total is None else parameters_addition(total, vec)
        survivors = sorted(masked)
        reason = (None if len(survivors) >= threshold else
                  f"{len(survivors)} nodes sent their masked vectors, fewer than the threshold {threshold}; "
                  "not unmasked")
        reason = reason or proceed(survivors)
        if reason or total is None:
            return SecureSumResult(None, survivors, dropped, reason or "no masked vector")
        total = parameters_mod(total, m)
        dead = sorted(set(sampled) - set(survivors))
        confirmations = self._confirm(grid, survivors, group, dropped)
        if confirmations is None:
            return SecureSumResult(None, survivors, dropped, "a survivor did not confirm the survivors; not unmasked")

        def unmask(nid: int) -> RecordDict:
            return RecordDict({RECORD_KEY_CONFIGS: ConfigRecord({
                Key.STAGE: Stage.UNMASK, Key.ACTIVE_NODE_ID_LIST: list(survivors),
                Key.DEAD_NODE_ID_LIST: list(dead), PEERS: confirmations[nid][0],
                CONFIRMATIONS: confirmations[nid][1]})})

        answers = self._exchange(grid, {n: unmask(n) for n in survivors}, group, dropped, "unmask")
        collected: dict[int, list[bytes]] = {n: [] for n in sampled}
        for rec in answers.values():
            for owner, share in zip(cast(list[int], rec[Key.NODE_ID_LIST]), cast(list[bytes], rec[Key.SHARE_LIST]),
                                    strict=True):
                if owner in collected:
                    collected[owner].append(share)
        shapes = [a.shape for a in total]
        for nid in sampled:
            if len(collected[nid]) < threshold:
                return SecureSumResult(None, survivors, dropped,
                                       f"{len(collected[nid])} shares of node {nid}'s secret < {threshold}")
            secret = combine_shares(collected[nid])
            if nid in survivors:  # its private mask
                total = parameters_subtraction(total, pseudo_rand_gen(secret, m, shapes))
                continue
            for other in survivors:  # a dropped node's pairwise masks with the nodes in the sum
                key = generate_shared_key(bytes_to_private_key(secret), bytes_to_public_key(public[other][0]))
                mask = pseudo_rand_gen(key, m, shapes)
                total = parameters_addition(total, mask) if nid > other else parameters_subtraction(total, mask)
        if dead:
            log(WARNING, "secure aggregation: %d node(s) left after sharing keys; their masks were removed",
                len(dead))
        return SecureSumResult([np.asarray(a, dtype=np.int64) for a in parameters_mod(total, m)], survivors, dropped)


__all__ = ["SecureSum", "SecureSumResult"]
