"""Run the project's ServerApp and ClientApp in Flower's Ray simulation from Python.

This is what ``flwr run apps/<name>`` does, minus the SuperLink: Flower's
``run_simulation`` with the real handlers of the Flower Apps in ``apps/`` (joint DP,
its FedAvg baseline, DP-MTL, Priv-AltMin), a run config given
as a dict (``run_simulation`` has no run-config argument, so every handler sees a
copy of its ``Context`` with the overrides applied), and ``num_supernodes``
SuperNodes. Node ``i`` gets ``partition-id = i`` and ``num-partitions =
num_supernodes`` and hosts the owners ``flwr_jdp.joint_dp.protocol.hosted_owners`` assigns
to it, so one SuperNode may host many owners (fewer, larger messages).

Used by the benchmarks, the tests and ``python -m research.reproduce_joint_dp``; from
the repository root (``research/`` and ``apps/`` are not installed)::

    from research.simulation import simulate
    simulate("joint-dp", {"num-owners": 8, "num-rounds": 2, "results-dir": "results/sim"}, num_supernodes=2)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

APPS = ("joint-dp", "fedavg", "priv-altmin", "dp-mtl")


class TimedGrid:
    """A Grid proxy that times every ``send_and_receive`` by message type."""

    def __init__(self, grid: Any) -> None:
        self._grid = grid
        self.phases: dict[str, float] = {}
        self.calls: dict[str, list[float]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(self, messages, *args, **kwargs):  # noqa: ANN001
        messages = list(messages)
        kind = messages[0].metadata.message_type if messages else "none"
        t = time.time()
        replies = list(self._grid.send_and_receive(messages, *args, **kwargs))
        self.phases[kind] = self.phases.get(kind, 0.0) + time.time() - t
        self.calls.setdefault(kind, []).append(round(time.time() - t, 3))
        return replies


def simulate(
    app: str,
    run_config: dict[str, Any],
    num_supernodes: int,
    log_level: str = "ERROR",
    wrap: Callable[[str, Callable], Callable] | None = None,
    ray_address: str | None = None,
) -> dict[str, Any]:
    """Run one Flower simulation of ``app`` (``joint-dp``: the project's apps for
    every method; ``fedavg``: plain Flower FedAvg; ``priv-altmin``: the Priv-AltMin app; ``dp-mtl``: the DP-MTL app) and return its wall seconds:
    ``seconds`` for the whole ServerApp, ``phases`` (seconds inside
    ``Grid.send_and_receive`` per message type), ``calls`` (seconds of each call
    per message type) and ``server_side`` (the rest).

    ``ray_address`` (e.g. ``"127.0.0.1:6379"`` or ``"auto"``) runs the ClientApps
    on an existing Ray cluster (``ray start --head`` ...) instead of a Ray that
    Flower starts; ``RAY_ADDRESS`` in the environment does the same.

    ``wrap(kind, handler) -> handler`` may replace the ClientApp's ``query``,
    ``train`` and ``evaluate`` handlers (fault injection in tests)."""
    from flwr.app import Context
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    from apps.dp_mtl.dp_mtl import client_app as mtl_client
    from apps.dp_mtl.dp_mtl import server_app as mtl_server
    from apps.fedavg.fedavg import client_app as fedavg_client
    from apps.fedavg.fedavg import server_app as fedavg_server
    from apps.joint_dp.joint_dp import client_app as jdp_client
    from apps.joint_dp.joint_dp import server_app as jdp_server
    from apps.priv_altmin.priv_altmin import client_app as altmin_client
    from apps.priv_altmin.priv_altmin import server_app as altmin_server

    if app not in APPS:
        raise ValueError(f"app must be one of {APPS}, got {app!r}")

    def configured(context: Context) -> Context:
        return Context(context.run_id, context.node_id, context.node_config, context.state,
                       {**context.run_config, **run_config})

    def with_config(handler: Callable, kind: str = "") -> Callable:
        inner = wrap(kind, handler) if wrap is not None else handler

        def wrapped(msg, context):  # noqa: ANN001, ANN202
            return inner(msg, configured(context))
        return wrapped

    client = ClientApp()
    server = ServerApp()
    if app == "fedavg":
        client.train()(with_config(fedavg_client.train, "train"))
        client.evaluate()(with_config(fedavg_client.evaluate_owner, "evaluate"))
        server_main = fedavg_server.main
    elif app == "priv-altmin":
        client.train("init")(with_config(altmin_client.init_stats, "train"))
        client.train()(with_config(altmin_client.epoch_stats, "train"))
        client.evaluate()(with_config(altmin_client.evaluate, "evaluate"))
        server_main = altmin_server.main
    elif app == "dp-mtl":
        client.query()(with_config(mtl_client.setup, "query"))
        client.train()(with_config(mtl_client.train, "train"))
        client.evaluate()(with_config(mtl_client.evaluate, "evaluate"))
        server_main = mtl_server.main
    else:
        # the app itself, mods included (one SuperNode hosts several owners)
        client.query()(with_config(jdp_client.app, "query"))
        client.train()(with_config(jdp_client.app, "train"))
        client.evaluate()(with_config(jdp_client.app, "evaluate"))
        server_main = jdp_server.main
    timing: dict[str, Any] = {}

    @server.main()
    def main(grid, context):  # noqa: ANN001, ANN202
        timed = TimedGrid(grid)
        t0 = time.time()
        try:
            server_main(timed, configured(context))
        except BaseException as err:  # surfaced to the caller below
            timing["error"] = err
        timing["seconds"] = time.time() - t0
        timing["phases"] = dict(timed.phases)
        timing["calls"] = dict(timed.calls)
        timing["server_side"] = timing["seconds"] - sum(timed.phases.values())

    init_args: dict[str, Any] = {"logging_level": log_level, "log_to_driver": False,
                                 "include_dashboard": False}  # ~220 MB saved
    if ray_address:
        init_args["address"] = ray_address
    run_simulation(server_app=server, client_app=client, num_supernodes=num_supernodes,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": init_args})
    if "error" in timing:
        raise RuntimeError(f"the simulated run failed: {timing['error']}") from timing["error"]
    if "seconds" not in timing:
        raise RuntimeError("the simulated ServerApp did not run (see Flower's log)")
    return timing


__all__ = ["APPS", "TimedGrid", "simulate"]
