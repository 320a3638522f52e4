"""Flower Server/ClientApps of flwr-jdp (importable as ``flwr_jdp.apps``).

``pyproject.toml`` names them as the Flower App's components:
``flwr_jdp.apps.server_app:app`` and ``flwr_jdp.apps.client_app:app``.
"""
