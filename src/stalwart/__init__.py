"""stalwart: reliable, elastic LLM pretraining on PyTorch.

For scripts run under `stalwart run`: call ``stalwart.report(step, loss=...)`` after each optimizer
step, wrap long non-step work in ``with stalwart.phase("eval"):`` so hang detection allows for it, and
call ``stalwart.finished()`` after the last step; ``stalwart.incident(kind, cls, step, **detail)``
journals something the script detected itself (e.g. a rollback); ``with stalwart.timer("name"):``
times a section of the step into the per-rank step records (under `stalwart train`). All are cheap
no-ops without an agent, and ``import stalwart`` stays cheap (stdlib only: the worker ↔ agent
contract, ``stalwart.runtime``).
"""

from stalwart.runtime import finished, incident, phase, report, timer

__version__ = "0.1.0"
__all__ = ["__version__", "finished", "incident", "phase", "report", "timer"]
