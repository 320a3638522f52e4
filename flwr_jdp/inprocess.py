"""An in-process Flower Grid: runs a real ClientApp on simulated nodes, no Ray.

For tests and micro-benchmarks: the ServerApp side (a strategy) and the ClientApp
are the real ones; only the transport is replaced by direct calls. Every reply can
be captured (to prove what leaves an owner), and faults can be injected.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

Fault = Callable[[Message, Message], Message | None]


class InProcessGrid(Grid):
    """A Grid whose nodes are in-process contexts of one ClientApp.

    Parameters
    ----------
    client_app : ClientApp
        The ClientApp every node runs.
    num_nodes : int
        Number of nodes; node ``i`` gets ``partition-id = i``.
    run_config : dict
        The run config every node sees.
    fault : callable, optional
        ``(instruction, reply) -> reply'`` applied to every reply (None drops it):
        used to inject malformed replies and failures.
    node_config : dict, optional
        Extra node-config entries of every node (e.g. ``state-dir``).
    node_configs : dict, optional
        Extra node-config entries of single nodes, by partition id (e.g.
        ``{1: {"max-epsilon": 1.0}}``), over ``node_config``.
    errors_as_replies : bool
        As Flower's SuperNode does: an exception the ClientApp raises becomes an
        error reply naming it (default: it propagates, so a test sees its traceback).
    """

    def __init__(self, client_app: ClientApp, num_nodes: int, run_config: dict[str, Any],
                 fault: Fault | None = None, node_config: dict[str, Any] | None = None,
                 errors_as_replies: bool = False, node_configs: dict[int, dict[str, Any]] | None = None) -> None:
        self.client_app = client_app
        self.fault = fault
        self.errors_as_replies = errors_as_replies
        self.sent: list[Message] = []  # every reply a ClientApp produced
        self.contexts = {
            1000 + i: Context(run_id=1, node_id=1000 + i,
                              node_config={"partition-id": i, "num-partitions": num_nodes,
                                           **(node_config or {}), **(node_configs or {}).get(i, {})},
                              state=RecordDict(), run_config=dict(run_config))
            for i in range(num_nodes)
        }
        self._run = None
        # Messages are stamped with the identity of the task that creates them.
        for attr, value in (("run_id", 1), ("task_id", 1), ("node_id", 0)):
            if getattr(TaskIdentity, f"_{attr}") is None:
                setattr(TaskIdentity, attr, value)

    def set_run(self, run: Any) -> None:
        self._run = run

    @property
    def run(self) -> Any:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError("use send_and_receive")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError("use send_and_receive")

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        replies = []
        for msg in messages:
            try:
                reply = self.client_app(msg, self.contexts[msg.metadata.dst_node_id])
            except Exception as err:
                if not self.errors_as_replies:
                    raise
                reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                      reason=f"{type(err).__name__}:{err}"), reply_to=msg)
            self.sent.append(reply)
            if self.fault is not None:
                reply = self.fault(msg, reply)
            if reply is not None:
                replies.append(reply)
        return replies
