"""Metrics: refusal detection and the task metrics."""
