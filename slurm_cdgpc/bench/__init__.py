"""Benchmarks behind ``cdgpc-admin bench``: each measures the real code path and returns JSON."""
