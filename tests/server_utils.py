"""Test helpers: the server launcher lives in swiftserve.bench.launch (benchmarks use it too)."""

from swiftserve.bench.launch import Server, free_port, running_server

__all__ = ["Server", "free_port", "running_server"]
