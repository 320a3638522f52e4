"""Paper reproductions, one module per paper; each runs Flower simulations of the
project's own apps (see :mod:`flwr_jdp.simulation`)."""
