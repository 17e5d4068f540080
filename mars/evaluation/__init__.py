"""Evaluation phase: benchmarks, the evaluate run, the code sandbox, plots and the promotion gate."""
