"""Model definitions (plain PyTorch) and the named size registry."""

from stalwart.models.llama import ModelArgs, Transformer, count_params
from stalwart.models.registry import SPECS, ModelSpec, get_spec, meta_param_count, model_args

__all__ = ["ModelArgs", "Transformer", "count_params", "SPECS", "ModelSpec", "get_spec",
           "meta_param_count", "model_args"]
