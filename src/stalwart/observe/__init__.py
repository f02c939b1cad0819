"""Observability: per-step metrics files and the console progress display."""
