"""Token data: preparation into memory-mapped shards, reading, and the global sampler."""

from stalwart.data.dataset import TokenDataset
from stalwart.data.prefetch import BatchLoader
from stalwart.data.prepare import ensure_default_corpus, prepare
from stalwart.data.sampler import GlobalSampler

__all__ = ["BatchLoader", "GlobalSampler", "TokenDataset", "ensure_default_corpus", "prepare"]
