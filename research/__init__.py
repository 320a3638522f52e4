"""Research code of flwr-jdp: the paper reproductions and what only they use.

Not installed with the package (``flwr_jdp`` never imports it); run from the
repository root, e.g. ``python -m research.reproduce_joint_dp --help``. The
example scripts under ``examples/`` put the repository root on ``sys.path``.

- :mod:`research.simulation`: the project's own ServerApp/ClientApp in Flower's
  Ray simulation, from Python.
- :mod:`research.reproduce_joint_dp`: one cell of the joint-DP paper's tables.
- :mod:`research.results_csv`, :mod:`research.runs_archive`: the result tables
  and the archived per-run folders of the reproductions.
"""
