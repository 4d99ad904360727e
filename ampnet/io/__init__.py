"""Saving and loading: atomic group writes, RNG and scheduler state, file checks."""
