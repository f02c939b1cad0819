"""Small helpers shared across stalwart."""

from stalwart.utils.hashing import state_dict_hash, tensor_digest

__all__ = ["state_dict_hash", "tensor_digest"]
