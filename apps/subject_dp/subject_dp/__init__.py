"""The subject-level DP Flower App (``server_app``, ``client_app``): subject-level DP
across silos; the model and the silos' data: :mod:`flwr_jdp.subject.task`,
:mod:`flwr_jdp.subject.silo_data`.
"""
