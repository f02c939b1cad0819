"""stalwart: reliable, elastic LLM pretraining on PyTorch."""

__version__ = "0.1.0"
