"""Benchmark harness: every benchmark runs its contenders side by side in one process."""
