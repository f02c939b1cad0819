"""Exceptions the CLI turns into exit codes (kept free of heavy imports)."""


class WorkersFailed(RuntimeError):
    """A spawned worker exited non-zero; the message names the first failure."""
