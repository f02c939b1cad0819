"""Fault injection for tests and demos: faults named in ``STALWART_CHAOS`` fire at named points.

    STALWART_CHAOS="kill:rank=1:step=7"                 SIGKILL rank 1 after step 7 (its node's snapshots whole)
    STALWART_CHAOS="kill:rank=0:step=5:at=copy"         ... while its step-5 snapshot is being copied
    STALWART_CHAOS="kill:rank=0:step=5:at=saved"        ... after step 5's checkpoint call, before its metrics record
    STALWART_CHAOS="kill:step=10:at=persist"            the keeper, while it writes step 10
    STALWART_CHAOS="delay:seconds=2:at=persist"         slow every persist down by 2 s
    STALWART_CHAOS="delay:seconds=1:at=retention"       the keeper, between a commit and its retention

Several faults are separated by ``;``. Code asks ``due(point, step=..., rank=...)`` and fires what it
returns. See :mod:`stalwart.chaos.faults` for the grammar.
"""

from stalwart.chaos.faults import ENV_DIR, ENV_SPEC, Fault, due, parse, reset_cache

__all__ = ["ENV_DIR", "ENV_SPEC", "Fault", "due", "parse", "reset_cache"]
