"""Measurement shared by the tuner and the benchmark scripts: one workload, one definition of each figure."""
