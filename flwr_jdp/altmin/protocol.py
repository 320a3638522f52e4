"""Message keys of Priv-AltMin (server: :class:`flwr_jdp.strategies.PrivAltMin`, ClientApp:
the Priv-AltMin app, ``apps/priv_altmin``)."""

CONFIG, EMBEDDING, STATS, METRICS = "config", "embedding", "stats", "metrics"
#: Message type of the set-up exchange (a train message with this action).
INIT_ACTION = "train.init"
