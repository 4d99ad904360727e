"""Saving and loading a net's state (placeholder: filled by the persistence work)."""

__all__ = ["PersistenceMixin"]


class PersistenceMixin:
    """save_params/load_params with the loss-scaler state."""
