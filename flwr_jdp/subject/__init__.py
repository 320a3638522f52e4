"""Subject-level DP across silos (Marathe et al.): silo maps, the four local
mechanisms, group-privacy noise, and the horizontal accountant
(:mod:`flwr_jdp.privacy.horizontal`)."""
