"""stalwart: reliable, elastic LLM pretraining on PyTorch.

For scripts run under `stalwart run`: call ``stalwart.report(step, loss=...)`` after each optimizer
step, and wrap long non-step work in ``with stalwart.phase("eval"):`` so hang detection allows for it.
Both are cheap no-ops without an agent.
"""

from stalwart.launch.progress import phase, report

__version__ = "0.1.0"
__all__ = ["report", "phase", "__version__"]
