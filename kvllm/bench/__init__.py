"""Benchmarks: speed targets live here, never in unit tests."""
