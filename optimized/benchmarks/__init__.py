"""Measuring: bench, the parallel bench, the latency harness, physical floors, the budgets and their runner."""
