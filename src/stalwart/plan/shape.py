"""Model shape for planning: parameter counts by part, without building the model.

Memory and layout estimates need to know *where* parameters live (embedding on the first pipeline
stage, LM head on the last, matrices split by tensor parallelism, experts by expert parallelism),
so counts are derived analytically from the shape; a test checks the total against the real model
built on the meta device. Mixture-of-experts is described by parameters only (``num_experts``,
``top_k``, ``expert_hidden``): the registry has no MoE model yet, but expert parallelism can be
planned.
"""

from __future__ import annotations

from dataclasses import dataclass

from stalwart.models.llama import ModelArgs


@dataclass(frozen=True)
class ModelShape:
    name: str
    dim: int
    n_layers: int
    n_heads: int
    kv_heads: int
    ffn_hidden: int
    vocab_size: int
    mlp: str = "swiglu"  # swiglu | gelu
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    bias: bool = False
    tie_embeddings: bool = False
    learned_pos: int = 0  # rows of a learned position table (0: RoPE/ALiBi)
    max_seq_len: int = 2048  # the model's training context (default sequence length)
    num_experts: int = 0  # 0 = dense model
    top_k: int = 1
    expert_hidden: int = 0  # 0 = ffn_hidden
    moe_every: int = 1  # every k-th layer is MoE (1 = all layers)
    parallel_block: bool = False  # attention and MLP from one norm (one norm per layer, half the TP traffic)
    attn_window: int = 0  # sliding-window attention: keys per query (0 = the whole causal prefix)
    embed_norm: bool = False  # LayerNorm (weight + bias) after the embedding

    def __post_init__(self) -> None:
        for key in ("dim", "n_layers", "n_heads", "kv_heads", "ffn_hidden", "vocab_size"):
            if getattr(self, key) <= 0:
                raise ValueError(f"model {key} must be positive, got {getattr(self, key)}")
        if self.dim % self.n_heads:
            raise ValueError(f"model dim {self.dim} must be divisible by heads {self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"heads {self.n_heads} must be a multiple of kv-heads {self.kv_heads}")
        if self.mlp not in ("swiglu", "gelu"):
            raise ValueError(f"mlp must be swiglu or gelu, got {self.mlp!r}")
        if self.num_experts < 0 or (self.num_experts and not 1 <= self.top_k <= self.num_experts):
            raise ValueError(f"need 1 <= top-k <= experts (got top-k {self.top_k}, experts {self.num_experts})")
        if self.moe_every < 1:
            raise ValueError(f"moe_every must be >= 1, got {self.moe_every}")

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_args(cls, args: ModelArgs, name: str = "custom", **moe: int) -> ModelShape:
        return cls(
            name=name,
            dim=args.dim,
            n_layers=args.n_layers,
            n_heads=args.n_heads,
            kv_heads=args.kv_heads,
            ffn_hidden=args.hidden,
            vocab_size=args.vocab_size,
            mlp=args.mlp,
            norm=args.norm,
            bias=args.bias,
            tie_embeddings=args.tie_embeddings,
            learned_pos=args.max_seq_len if args.pos == "learned" else 0,
            max_seq_len=args.max_seq_len,
            parallel_block=args.parallel_block,
            attn_window=args.attn_window,
            embed_norm=args.embed_norm,
            **moe,
        )

    # -- dimensions -----------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def norms_per_layer(self) -> int:
        return 1 if self.parallel_block else 2

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_ffn(self) -> int:
        return self.expert_hidden or self.ffn_hidden

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers // self.moe_every if self.is_moe else 0

    # -- parameters by part ---------------------------------------------------------------------
    def norm_params(self) -> int:
        return self.dim * (2 if self.norm == "layernorm" and self.bias else 1)

    def attention_params(self) -> int:
        d, kv = self.dim, self.kv_dim
        return d * d * 2 + d * kv * 2 + ((d + 2 * kv + d) if self.bias else 0)

    def mlp_params(self, hidden: int | None = None) -> int:
        f = hidden or self.ffn_hidden
        n_in = 2 if self.mlp == "swiglu" else 1
        return n_in * self.dim * f + f * self.dim + ((n_in * f + self.dim) if self.bias else 0)

    def expert_params(self) -> int:
        """One expert's MLP."""
        return self.mlp_params(self.expert_ffn)

    def router_params(self) -> int:
        return self.dim * self.num_experts

    def layer_dense_params(self, moe_layer: bool = False) -> int:
        """Parameters of one layer that every expert-parallel rank holds (all but the experts)."""
        base = self.attention_params() + self.norms_per_layer * self.norm_params()
        return base + (self.router_params() if moe_layer else self.mlp_params())

    def embedding_params(self) -> int:
        return self.vocab_size * self.dim + self.learned_pos * self.dim + (2 * self.dim if self.embed_norm else 0)

    def head_params(self) -> int:
        """Final norm + output projection (the projection is shared when embeddings are tied)."""
        return self.norm_params() + (0 if self.tie_embeddings else self.vocab_size * self.dim)

    def total_params(self) -> int:
        dense_layers = self.n_layers - self.n_moe_layers
        moe = self.n_moe_layers * (self.layer_dense_params(True) + self.num_experts * self.expert_params())
        return self.embedding_params() + dense_layers * self.layer_dense_params() + moe + self.head_params()

    def active_params(self) -> int:
        """Parameters that touch each token (all of a dense model; top-k experts of a MoE)."""
        if not self.is_moe:
            return self.total_params()
        idle = self.n_moe_layers * (self.num_experts - self.top_k) * self.expert_params()
        return self.total_params() - idle

    def head_flop_share(self) -> float:
        """Output projection FLOPs in units of one transformer layer's (for pipeline balance)."""
        layer = self.attention_params() + (self.mlp_params() if not self.is_moe else self.top_k * self.expert_params())
        return self.vocab_size * self.dim / layer


def shape_for(name: str, **moe: int) -> ModelShape:
    """The registry model ``name`` as a planning shape (optionally turned into a MoE)."""
    from stalwart.models.registry import get_spec

    return ModelShape.from_args(get_spec(name).args, name=name, **moe)
