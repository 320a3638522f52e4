"""Message keys of DP mean-regularized MTL (server: :class:`flwr_jdp.strategies.DPMeanRegularizedMTL`,
ClientApp: the DP-MTL app, ``apps/dp_mtl``, or a user's own app with :class:`flwr_jdp.mtl.client.MTLClient`)."""

CONFIG, MEAN, MODELS, METRICS, SETUP = "config", "mean", "models", "metrics", "setup"
TASKS, ROUND = "tasks", "round"


def task_key(task_id: int) -> str:
    return f"task.{int(task_id)}"


def parse_task_key(key: str) -> int | None:
    head, _, rest = key.partition(".")
    return int(rest) if head == "task" and rest.isdigit() else None

# Set-up keys of the drop-in client half (:class:`flwr_jdp.mtl.client.MTLClient`):
# the flattened parameter count of the ClientApp's model, its parameter names and
# shapes (``named_parameters`` order, the order ``w_k`` is flattened in) and the
# federation's number of partitions (one task per node).
NUM_PARAMS, PARAM_NAMES, PARAM_SHAPES, NUM_PARTITIONS = "num-params", "param-names", "param-shapes", "num-partitions"
#: Evaluate replies of drop-in apps: the test-set size each task's metrics are weighted by.
NUM_EXAMPLES = "num-examples"
