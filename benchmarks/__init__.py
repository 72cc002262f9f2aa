"""normkit's benchmark: ``python3 benchmarks/bench.py`` on a GPU; see benchmarks/README.md."""
