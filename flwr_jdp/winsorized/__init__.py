"""The winsorized user-level mean: estimator (``estimator``), Flower strategy
(``strategy``), user-level DP-SGD built on it (``user_level_sgd``)."""
