"""Benchmarks run by hand (``python -m bench.<name>``); each prints one summary line last."""
