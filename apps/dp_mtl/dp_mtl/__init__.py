"""The DP-MTL Flower App: DP mean-regularized multi-task learning (``server_app``,
``client_app``); the tasks' data come from the run config (:mod:`flwr_jdp.mtl.tasks`).
"""
