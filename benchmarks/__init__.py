"""Measurement, outside the product (not in the wheel): the bench and its peers, load, chaos and
scale-out runs against the app, the screenshots, and the research probes that docs/benchmarks.md
cites. Each runs from a checkout as ``python -m benchmarks.NAME`` (the Makefile's targets)."""
