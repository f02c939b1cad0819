"""Model definitions (plain PyTorch) and the named size registry."""

from stalwart.models.llama import ModelArgs, Transformer, count_params
from stalwart.models.moe import MoEArgs, MoETransformer
from stalwart.models.registry import SPECS, ModelSpec, build_model, get_spec, meta_param_count, model_args, moe_args

__all__ = [
    "SPECS",
    "MoEArgs",
    "MoETransformer",
    "ModelArgs",
    "ModelSpec",
    "Transformer",
    "build_model",
    "count_params",
    "get_spec",
    "meta_param_count",
    "model_args",
    "moe_args",
]
