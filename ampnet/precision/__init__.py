"""Precision: policy, per-module plan, regions, master weights, loss scaler and report."""
