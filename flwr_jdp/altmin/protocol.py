"""Message keys of Priv-AltMin (server: :class:`flwr_jdp.strategies.PrivAltMin`, ClientApp:
:mod:`flwr_jdp.altmin.app`)."""

CONFIG, EMBEDDING, STATS, METRICS = "config", "embedding", "stats", "metrics"
#: Message type of the set-up exchange (a train message with this action).
INIT_ACTION = "train.init"
