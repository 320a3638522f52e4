"""Start-up discovery shared by the strategies: ask every connected node a set-up query.

A strategy learns which owners, tasks or silos each node hosts by sending it a QUERY
message before the first round. Nodes may still be joining, or be too busy to answer
at once (a simulation starting on a loaded machine), so every connected node is asked
until it answers once, up to a deadline. Flower's ``Grid.send_and_receive`` returns when
every reply is in or at its timeout, so there a silent node holds a pass until the
deadline: the passes after the first reach nodes that connected while it ran (and, on a
grid that returns early, nodes whose reply never came). In every case the nodes that
never answered are returned, so a caller can name them instead of blaming its
configuration. This module only carries the replies: what a
reply discloses (which owners, tasks or silos a node hosts, record counts) and whether
the guarantee covers it is set and stated by each strategy (for example, subject-level
DP's reported per-subject counts, sent only with ``max-records-per-subject = 0``, are
metadata outside its guarantee; see its module docstring).
Asking a silent node again sends the same query again and discloses nothing new.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from flwr.app import Message
from flwr.serverapp import Grid


def query_nodes(
    grid: Grid,
    message_for: Callable[[int], Message],
    handle: Callable[[Message], None],
    done: Callable[[], bool],
    deadline: float,
    pause: float = 1.0,
) -> tuple[set[int], list[int]]:
    """Send ``message_for(node)`` to every connected node that has not answered yet and
    pass each reply to ``handle``; repeat until ``done()`` or ``time.time() > deadline``.

    A node that stays silent is asked again on the next pass (each pass waits at most
    until the deadline); one that answered, well or badly, is never asked again.
    Returns ``(answered, silent)``: the nodes that answered, and the connected nodes
    that never did, so a caller can tell a silent node from a wrong configuration."""
    answered: set[int] = set()
    while not done():
        nodes = [n for n in grid.get_node_ids() if n not in answered]
        if nodes:
            left = max(1.0, deadline - time.time())
            for reply in grid.send_and_receive([message_for(n) for n in nodes], timeout=left):
                answered.add(reply.metadata.src_node_id)
                handle(reply)
        if done() or time.time() > deadline:
            break
        time.sleep(pause)
    return answered, sorted(set(grid.get_node_ids()) - answered)
