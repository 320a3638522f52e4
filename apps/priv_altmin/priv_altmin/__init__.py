"""The Priv-AltMin Flower App (``server_app``, ``client_app``): user-level DP shared
embedding, each user's ``v_j`` kept local.
"""
