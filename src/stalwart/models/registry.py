"""Named model shapes: small ones to train on a CPU, paper shapes to plan with.

``published_params`` is the total reported by the model's authors (paper or model card); the test
suite checks our meta-device count against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stalwart.models.llama import ModelArgs, Transformer, count_params
from stalwart.models.moe import MoEArgs, MoETransformer


@dataclass(frozen=True)
class ModelSpec:
    name: str
    args: ModelArgs
    published_params: float | None = None
    source: str = ""
    moe: MoEArgs | None = None  # set for mixture-of-experts shapes (the dense fields describe the rest)


_GPT = dict(mlp="gelu", norm="layernorm", bias=True, tie_embeddings=True)

SPECS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec(
            "debug",
            ModelArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=257, ffn_hidden=512, max_seq_len=512),
        ),
        ModelSpec(
            "debug-moe",
            ModelArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=257, ffn_hidden=512, max_seq_len=512),
            moe=MoEArgs(num_experts=4, top_k=2, expert_hidden=256, moe_every=1, aux_loss_coef=0.01),
        ),
        ModelSpec(
            "small",
            ModelArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=257, ffn_hidden=1536, max_seq_len=1024),
        ),
        ModelSpec(
            "llama2-7b",
            ModelArgs(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, ffn_hidden=11008, max_seq_len=4096),
            6.738e9,
            "Touvron et al. 2023, Llama 2 (HF card 6.74B)",
        ),
        ModelSpec(
            "llama2-13b",
            ModelArgs(dim=5120, n_layers=40, n_heads=40, vocab_size=32000, ffn_hidden=13824, max_seq_len=4096),
            13.016e9,
            "Touvron et al. 2023, Llama 2 (HF card 13.0B)",
        ),
        ModelSpec(
            "llama2-70b",
            ModelArgs(
                dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000, ffn_hidden=28672, max_seq_len=4096
            ),
            68.977e9,
            "Touvron et al. 2023, Llama 2 (HF card 69.0B)",
        ),
        ModelSpec(
            "llama3-8b",
            ModelArgs(
                dim=4096,
                n_layers=32,
                n_heads=32,
                n_kv_heads=8,
                vocab_size=128256,
                ffn_hidden=14336,
                max_seq_len=8192,
                rope_theta=500000.0,
            ),
            8.030e9,
            "Llama 3 herd, 2024 (HF card 8.03B)",
        ),
        ModelSpec(
            "llama3-70b",
            ModelArgs(
                dim=8192,
                n_layers=80,
                n_heads=64,
                n_kv_heads=8,
                vocab_size=128256,
                ffn_hidden=28672,
                max_seq_len=8192,
                rope_theta=500000.0,
            ),
            70.554e9,
            "Llama 3 herd, 2024 (HF card 70.6B)",
        ),
        ModelSpec(
            "llama3-405b",
            ModelArgs(
                dim=16384,
                n_layers=126,
                n_heads=128,
                n_kv_heads=8,
                vocab_size=128256,
                ffn_hidden=53248,
                max_seq_len=8192,
                rope_theta=500000.0,
            ),
            405.853e9,
            "Llama 3 herd, 2024, Table 3 (HF card 406B)",
        ),
        ModelSpec(
            "gpt3-175b",
            ModelArgs(dim=12288, n_layers=96, n_heads=96, vocab_size=50257, pos="learned", max_seq_len=2048, **_GPT),
            175.0e9,
            "Brown et al. 2020, Table 2.1",
        ),
        ModelSpec(
            "opt-175b",
            ModelArgs(dim=12288, n_layers=96, n_heads=96, vocab_size=50272, pos="learned", max_seq_len=2048, **_GPT),
            175.0e9,
            "Zhang et al. 2022, OPT Table 1",
        ),
        ModelSpec(
            "bloom-176b",
            ModelArgs(dim=14336, n_layers=70, n_heads=112, vocab_size=250880, pos="alibi", max_seq_len=2048, **_GPT),
            176.247e9,
            "BigScience 2022, BLOOM model card",
        ),
        ModelSpec(
            "falcon-180b",
            ModelArgs(dim=14848, n_layers=80, n_heads=232, n_kv_heads=8, vocab_size=65024, max_seq_len=2048, **_GPT),
            180.0e9,
            "Almazrouei et al. 2023, The Falcon Series",
        ),
    )
}


def get_spec(name: str) -> ModelSpec:
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(SPECS)}") from None


def model_args(name: str, **overrides: object) -> ModelArgs:
    return get_spec(name).args.with_(**overrides)


def meta_param_count(args: ModelArgs) -> int:
    """Exact parameter count without allocating memory (built on the meta device)."""
    with torch.device("meta"):
        return count_params(Transformer(args))


def moe_args(name: str) -> MoEArgs | None:
    """MoE settings of a registry model (None for a dense one)."""
    return get_spec(name).moe


def build_model(name: str, args: ModelArgs) -> Transformer:
    """The model class that ``name`` needs (dense or MoE), built with ``args`` (not initialised)."""
    moe = moe_args(name)
    return MoETransformer(args, moe) if moe is not None else Transformer(args)
