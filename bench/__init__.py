"""Benchmarks: `make bench` runs every bench_*.py module's ``main()`` and prints figures and ratios."""
