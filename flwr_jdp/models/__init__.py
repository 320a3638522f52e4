"""Models."""

from .seed_cnn import DEFAULT_PERSONAL_RULE, SeedCNN, build_model

__all__ = ["DEFAULT_PERSONAL_RULE", "SeedCNN", "build_model"]
