"""Benchmarks: run as modules (python -m benchmarks.<name>); speed is measured here, never in tests."""
