"""Benchmarks: each checks its kernel's result first, then times it next to a baseline in the same run."""
