"""Set-up of :class:`~flwr_jdp.strategies.JointDP`: before any release, ask every node which
owners it hosts and their sizes, check each node's model against ``initial_arrays``
(whose personal values are sent as the public initial values), and register the owners.
"""

from __future__ import annotations

import dataclasses
import math
import time
from logging import WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.config import ConfigError, minimum_survivors
from flwr_jdp.joint_dp.schedule import OwnerSize, build_schedule, units_of
from flwr_jdp.joint_dp.secure_sum import MIN_NODES, minimum_threshold
from flwr_jdp.joint_dp.validation import ArraySpec, max_sampled_units
from flwr_jdp.node_query import query_nodes
from flwr_jdp.params import split_names
from flwr_jdp.privacy.skellam import choose_scale
from flwr_jdp.privacy.units import PrivacyUnit


class NodeSetup:
    """How JointDP finds its owners and checks their models (before any privacy is spent).

    A part of :class:`~flwr_jdp.strategies.JointDP` (which holds the state it uses).
    """

    def _split_initial(self, initial: ArrayRecord) -> None:
        """Shared/personal split of the user's ``initial_arrays`` by ``personal-layers``."""
        names = list(initial.keys())
        values = {n: initial[n].numpy() for n in names}
        self.model_spec = {n: ArraySpec(tuple(v.shape), str(v.dtype)) for n, v in values.items()}
        try:
            split = split_names(names, self.cfg.effective_personal_rule,
                                allow_empty=self.cfg.method != "joint-dp", what="initial_arrays")
        except ValueError as err:
            raise ConfigError(f"run-config key '{self._key('personal-layers')}': {err}") from None
        self.public_initial = {n: values[n] for n in split.personal}
        self.num_personal = int(sum(values[n].size for n in split.personal))
        self.spec = {n: self.model_spec[n] for n in split.shared}

    def _check_model(self, names: list[str], shapes: list[str], node: int) -> None:
        """The ClientApp's model (as a node reported it) against ``initial_arrays``."""
        reported = dict(zip(names, shapes, strict=False))
        given = {n: "x".join(str(d) for d in spec.shape) or "scalar" for n, spec in self.model_spec.items()}
        extra = sorted(set(given) - set(reported))
        if extra:
            raise ConfigError(
                f"initial_arrays has {extra[:5]}, which are not parameters of the ClientApp's model "
                f"(node {node}); buffers such as BatchNorm statistics depend on the data and cannot be "
                "shared under DP: pass only parameters, e.g. ArrayRecord(dict(net.named_parameters()))"
                if any("running" in n or "num_batches" in n for n in extra) else
                f"initial_arrays has {extra[:5]}, which the ClientApp's model (node {node}) does not have")
        missing = sorted(set(reported) - set(given))
        if missing:
            raise ConfigError(f"initial_arrays lacks {missing[:5]} of the ClientApp's model (node {node})")
        wrong = [f"{n}: {given[n]} here, {reported[n]} in the ClientApp" for n in given if given[n] != reported[n]]
        if wrong:
            raise ConfigError(f"initial_arrays do not match the ClientApp's model (node {node}): {wrong[:3]}")

    def setup(self, grid: Grid, timeout: float = 120.0,
              initial_arrays: ArrayRecord | None = None) -> ArrayRecord:
        """Ask every node which owners it hosts, their sizes and caps (node config
        ``max-epsilon``), and check its model against ``initial_arrays``, whose personal
        values it is sent; return the initial shared arrays; compute the sampling
        schedule and (if asked) calibrate the noise multiplier, and under local noise
        one per capped group of owners. Fails with a message naming the key on a
        mismatch."""
        if initial_arrays is None:
            raise ConfigError("start() needs the model: pass start(initial_arrays=ArrayRecord("
                              "model.state_dict())) with the ClientApps' model's parameters")
        deadline = time.time() + timeout
        self._wait_for_nodes(grid, deadline)
        try:
            self._split_initial(initial_arrays)
            rule_error = None
        except ConfigError as err:  # raised once the nodes' models are known: if initial_arrays
            rule_error = err        # are not the ClientApp's model, that is the error to name
        query = RecordDict({protocol.CONFIG: ConfigRecord(),
                            protocol.PUBLIC_PERSONAL: protocol.to_record(self.public_initial)})

        def done() -> bool:
            if rule_error is not None:  # one node's model tells which error to name
                return bool(self._answered)
            if self.cfg.num_owners == 0:  # every node that is connected
                return bool(self._answered) and set(grid.get_node_ids()) <= self._answered
            return set(range(self.cfg.num_owners)) <= set(self.owner_node)

        answered, silent = query_nodes(
            grid, lambda n: Message(query, dst_node_id=n, message_type=MessageType.QUERY),
            self._register_node, done, deadline)
        if rule_error is not None:
            raise rule_error
        wanted = range(self.cfg.num_owners) if self.cfg.num_owners else sorted(self.owner_node)
        missing = sorted(set(wanted) - set(self.owner_node))
        if not self.owner_node:
            raise RuntimeError(f"no node hosts an owner ({len(answered)} nodes answered the set-up)")
        if missing:
            shown = f"{missing[:10]}{'...' if len(missing) > 10 else ''}"
            if silent:
                raise RuntimeError(
                    f"{len(silent)} of {len(silent) + len(answered)} connected nodes did not answer the "
                    f"set-up query within {timeout:g} s (nodes {silent[:10]}), so owners {shown} are "
                    "unaccounted for: the nodes may still be starting on a busy machine, or have failed"
                )
            raise ConfigError(
                f"run-config key '{self._key('num-owners')}'={self.cfg.num_owners} but no node hosts owners "
                f"{shown} ({len(answered)} nodes connected, all answered)"
            )
        self.schedule = build_schedule(self.cfg, self.sizes)
        full = [o for o, q in self.schedule.owner_rates.items() if q >= 1.0]
        if self.cfg.dp and full and self.cfg.unit is not PrivacyUnit.OWNER:
            log(WARNING, "%s of %d owners hold no more units than '%s' = %g: their batches take every unit "
                "(no amplification by sampling for them)", len(full), len(self.sizes), self._key("batch-size"),
                self.cfg.batch_size)
        if self.kind == protocol.KIND_SECURE_SUM:
            self._plan_secure_sum(grid)
        self._calibrate()
        return protocol.to_record({n: initial_arrays[n].numpy() for n in self.spec})

    def _plan_secure_sum(self, grid: Grid) -> None:
        """Distributed noise: the encoding's dimension and scale, fixed before any release."""
        hosts = set(self.owner_node.values())
        if len(hosts) < MIN_NODES:
            raise ConfigError(f"run-config key '{self._key('noise-placement')}'='distributed' needs at least "
                              f"{MIN_NODES} nodes for secure aggregation (Flower's SecAgg+ masks need three "
                              f"nodes to hide each one's vector); the owners are on {len(hosts)}")
        survivors, needed = minimum_survivors(len(hosts), self.cfg.dropout_tolerance), minimum_threshold(len(hosts))
        if survivors < needed:  # the configured dropouts would leave fewer nodes than the threshold nodes accept
            raise ConfigError(
                f"run-config key '{self._key('dropout-tolerance')}'={self.cfg.dropout_tolerance} lets "
                f"{len(hosts) - survivors} of the {len(hosts)} nodes drop out, but the secure sum's threshold over "
                f"{len(hosts)} nodes is {needed} (more than half, at least {MIN_NODES}): set it below "
                f"{1 - (needed - 1) / len(hosts):.3g}")
        assert self.schedule is not None
        dim = int(sum(int(np.prod(spec.shape)) for spec in self.spec.values()))
        rate = self.schedule.server_rate
        self.max_units = float(sum(max_sampled_units(units_of(self.cfg, s), rate) for s in self.sizes.values()))
        scale = choose_scale(self.cfg.clipping_norm, self.max_units, dim)
        self.schedule = dataclasses.replace(self.schedule, dim=dim, scale=scale)

    def _wait_for_nodes(self, grid: Grid, deadline: float, poll: float = 0.1) -> None:
        """Before the first query, let connecting nodes arrive: wait until as many
        nodes as owners are connected (no more can host an owner) or the count has
        not changed for ``node_settle_s`` seconds. Nodes that join later are still
        queried (see :meth:`setup`); this only saves a second round trip at start-up."""
        settle = self.node_settle_s
        if settle <= 0:
            return
        count, since = -1, time.time()
        while time.time() < deadline:
            now = len(list(grid.get_node_ids()))
            if self.cfg.num_owners and now >= self.cfg.num_owners:
                return
            if now != count:
                count, since = now, time.time()
            elif now > 0 and time.time() - since >= settle:
                return
            time.sleep(poll)

    def _register_node(self, reply: Message) -> None:
        """Record the owners a node hosts after checking its model."""
        if reply.has_error():
            hint = (": its ClientApp has no flwr-jdp client half; create JointDPClient(app, model_fn=..., "
                    "train_data=...) in the ClientApp (README, 'Use it in your own Flower app')"
                    if "No query function registered" in reply.error.reason else "")
            raise RuntimeError(
                f"node {reply.metadata.src_node_id} failed at set-up: {reply.error.reason}{hint}"
            )
        self._answered.add(reply.metadata.src_node_id)
        rec = reply.content[protocol.SETUP]
        if protocol.PARAM_NAMES not in rec:
            raise ConfigError(f"node {reply.metadata.src_node_id} replied to the set-up without its model's "
                              "parameter names: its ClientApp does not use flwr_jdp's JointDPClient")
        self._check_model(list(rec[protocol.PARAM_NAMES]), list(rec[protocol.PARAM_SHAPES]),
                          reply.metadata.src_node_id)
        owners = list(rec[protocol.OWNER_IDS])
        # each owner's cap, node config max-epsilon (0.0: none; absent from older client halves)
        caps = list(rec[protocol.MAX_EPSILON]) if protocol.MAX_EPSILON in rec else [0.0] * len(owners)
        if len(caps) != len(owners) or not all(math.isfinite(float(c)) and float(c) >= 0 for c in caps):
            raise ConfigError(f"node {reply.metadata.src_node_id} reported caps {caps[:5]} (node config "
                              f"'max-epsilon') for owners {owners[:5]}: each must be a number > 0")
        for o, nrec, nusr, cap in zip(owners, rec[protocol.NUM_RECORDS], rec[protocol.NUM_USERS], caps,
                                      strict=False):
            if int(o) in self.owner_node:
                raise ConfigError(f"owner {o} is hosted by two nodes; check node configs "
                                  "'partition-id' and 'num-partitions'")
            self.owner_node[int(o)] = reply.metadata.src_node_id
            self.sizes[int(o)] = OwnerSize(int(nrec), int(nusr))
            self.owner_caps[int(o)] = float(cap) if float(cap) > 0 else None


