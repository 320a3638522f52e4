"""Message keys of DP mean-regularized MTL (server: :class:`flwr_jdp.strategies.DPMeanRegularizedMTL`,
ClientApp: :mod:`flwr_jdp.apps.mtl_app`)."""

CONFIG, MEAN, MODELS, METRICS, SETUP = "config", "mean", "models", "metrics", "setup"
TASKS, ROUND = "tasks", "round"


def task_key(task_id: int) -> str:
    return f"task.{int(task_id)}"


def parse_task_key(key: str) -> int | None:
    head, _, rest = key.partition(".")
    return int(rest) if head == "task" and rest.isdigit() else None
