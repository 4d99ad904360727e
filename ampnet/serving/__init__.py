"""Serving: converting a fitted net to a precision for inference, and exporting it (TorchScript, ONNX)."""
