"""Decoding phase: the MARS sliding-window loop and its backends (PyTorch, exported ONNX); decode speed."""
