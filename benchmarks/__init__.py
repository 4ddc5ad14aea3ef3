"""Benchmarks for lightning-mics. ``python benchmarks/emulated_cluster.py --help`` is the entry point."""
