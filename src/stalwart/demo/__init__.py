"""The fault-tolerance demo (`stalwart demo`): an application of the launcher, not part of it.

``run``: the whole demo; ``job``: one 2-node job under injected faults; ``report``: what the recovery
cost; ``recovery_metrics``: the one definition of MTTR, regain, lost steps and goodput, shared with
``benchmarks/recovery.py``. Nothing is imported here, so the metrics stay importable without the
demo's dependencies.
"""
