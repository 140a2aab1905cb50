"""Benchmarks: offline throughput/latency (in-process)."""
