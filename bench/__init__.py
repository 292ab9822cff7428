"""Benchmarks: scripts that print a table and write JSON (and PNG), never tests. Run each as a
module from the repository root, e.g. ``python -m bench.pd_cluster --help`` (or its make
target: ``make bench-pd``)."""
