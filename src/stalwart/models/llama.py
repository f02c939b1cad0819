"""LLaMA-style decoder in plain PyTorch.

Parallelism (DDP, FSDP2, TP, PP, EP) is applied from outside (see ``stalwart.train.parallel``); this
module only knows tensors. Layers live in a ``ModuleDict`` keyed by index so a pipeline split can
delete layers without renumbering, as torchtitan does.

A few switches (``mlp``, ``norm``, ``pos``, ``bias``) let the same code express the GPT-3, OPT, BLOOM
and Falcon shapes that the planner needs; the trained default is RMSNorm + RoPE + SwiGLU + GQA.
Three more change the arithmetic, all off by default (docs/techniques.md): ``parallel_block``
(GPT-J/PaLM/MegaScale: ``x + attn(norm(x)) + mlp(norm(x))``), ``attn_window`` (sliding-window causal
attention) and ``embed_norm`` (BLOOM's LayerNorm after the token embedding).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    n_kv_heads: int | None = None  # None → multi-head attention (== n_heads)
    ffn_hidden: int | None = None  # None → SwiGLU 8/3·dim rounded up to `multiple_of`, GELU 4·dim
    multiple_of: int = 256
    mlp: str = "swiglu"  # swiglu | gelu
    norm: str = "rmsnorm"  # rmsnorm | layernorm
    pos: str = "rope"  # rope | learned | alibi
    bias: bool = False
    tie_embeddings: bool = False
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    parallel_block: bool = False  # attention and MLP read one normalised input; their sum joins the residual
    attn_window: int = 0  # > 0: each token attends to itself and the W - 1 tokens before it (0 = all before)
    embed_norm: bool = False  # LayerNorm after the token (+ position) embedding (BLOOM's StableEmbedding)

    def __post_init__(self) -> None:
        if self.attn_window < 0:
            raise ValueError(f"model.attn_window must be ≥ 0 (0 = full causal attention), got {self.attn_window}")
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}")
        if self.kv_heads <= 0 or self.n_heads % self.kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads={self.kv_heads}")
        for name, value, allowed in (
            ("mlp", self.mlp, ("swiglu", "gelu")),
            ("norm", self.norm, ("rmsnorm", "layernorm")),
            ("pos", self.pos, ("rope", "learned", "alibi")),
        ):
            if value not in allowed:
                raise ValueError(f"model.{name}={value!r} is not one of {allowed}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.mlp == "gelu":
            return 4 * self.dim
        h = int(2 * 4 * self.dim / 3)
        return self.multiple_of * math.ceil(h / self.multiple_of)

    def with_(self, **changes: object) -> ModelArgs:
        return replace(self, **changes)


def _norm(args: ModelArgs) -> nn.Module:
    if args.norm == "rmsnorm":
        return nn.RMSNorm(args.dim, eps=args.norm_eps)
    return nn.LayerNorm(args.dim, eps=args.norm_eps, bias=args.bias)


def rope_tables(head_dim: int, seq_len: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """cos/sin tables of shape (seq_len, head_dim // 2, 2) in float32."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x (batch, seq, heads, head_dim) by position, in fp32: each pair
    times cos + i·sin as one complex multiply (the pairs as real and imaginary parts). The same
    rotation written out on the pairs took ~10 elementwise kernels forward and backward: 3.7× the
    time on an H200, ~15 % of a 280M model's step (benchmarks/gpu_profile.py)."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    rotation = torch.view_as_complex(tables[: x.shape[1]])[:, None, :]
    return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)


def alibi_bias(n_heads: int, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
    """ALiBi causal bias (heads, seq, seq): linear distance penalty, -inf above the diagonal."""
    start = 2.0 ** (-8.0 / n_heads)
    slopes = torch.tensor([start ** (i + 1) for i in range(n_heads)], device=device)
    pos = torch.arange(seq_len, device=device)
    distance = (pos[None, :] - pos[:, None]).float()
    bias = slopes[:, None, None] * distance[None]
    return bias.masked_fill(distance[None] > 0, float("-inf"))


def window_mask(seq_len: int, window: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean (seq, seq) mask, True where query i may attend to key j: ``i - window < j ≤ i``."""
    pos = torch.arange(seq_len, device=device)
    distance = pos[:, None] - pos[None, :]
    return (distance >= 0) & (distance < window)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        hd = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * hd, bias=args.bias)
        self.wk = nn.Linear(args.dim, args.kv_heads * hd, bias=args.bias)
        self.wv = nn.Linear(args.dim, args.kv_heads * hd, bias=args.bias)
        self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=args.bias)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        b, s, _ = x.shape
        hd = self.args.head_dim
        # -1 instead of the head count keeps this correct when TP shards the projections.
        q = self.wq(x).view(b, s, -1, hd)
        k = self.wk(x).view(b, s, -1, hd)
        v = self.wv(x).view(b, s, -1, hd)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        gqa = q.shape[1] != k.shape[1]
        mask = attention_mask(self.args, s, x.device, q.dtype)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def attention_mask(args: ModelArgs, seq_len: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """The SDPA mask of ``args``' attention: ALiBi's bias and/or the sliding window; None for plain
    causal attention (``is_causal``, which lets torch pick a flash kernel)."""
    window, mask = args.attn_window, None
    if args.pos == "alibi":
        mask = alibi_bias(args.n_heads, seq_len, device).to(dtype)
        if 0 < window < seq_len:
            mask = mask.masked_fill(~window_mask(seq_len, window, device), float("-inf"))
    elif 0 < window < seq_len:
        mask = window_mask(seq_len, window, device)
    return mask


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.swiglu = args.mlp == "swiglu"
        self.w1 = nn.Linear(args.dim, args.hidden, bias=args.bias)
        self.w2 = nn.Linear(args.hidden, args.dim, bias=args.bias)
        self.w3 = nn.Linear(args.dim, args.hidden, bias=args.bias) if self.swiglu else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``+ mlp(norm(·))``; or, with ``parallel_block``, both
    branches from one norm of x and summed before they join the residual, so tensor parallelism
    reduces their partial outputs once (``ffn_norm`` is then absent)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.parallel = args.parallel_block
        self.attention_norm = _norm(args)
        self.attention = Attention(args)
        self.ffn_norm = None if self.parallel else _norm(args)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        if self.ffn_norm is None:
            h = self.attention_norm(x)
            return x + (self.attention(h, rope) + self.feed_forward(h))
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


def embed(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Token (+ learned position) embedding, then the embedding norm if the model has one; shared by
    the Transformer and a pipeline's first stage (same attribute names)."""
    h = model.tok_embeddings(tokens)
    if model.pos_embeddings is not None:
        h = h + model.pos_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
    return h if model.embed_norm is None else model.embed_norm(h)


class Transformer(nn.Module):
    """Decoder-only LM: tokens (batch, seq) → logits (batch, seq, vocab)."""

    # Parameters that write into the residual stream get the smaller init (GPT-2).
    residual_suffixes: tuple[str, ...] = ("wo.weight", "w2.weight")

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim) if args.pos == "learned" else None
        self.embed_norm = nn.LayerNorm(args.dim, eps=args.norm_eps) if args.embed_norm else None
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.norm = _norm(args)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        if args.pos == "rope":
            tables = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
            self.register_buffer("rope", tables, persistent=False)
        else:
            self.rope = None

    def initial_value(
        self, name: str, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, seed: int | None = None
    ) -> torch.Tensor:
        """The initial value of parameter ``name`` (its full, unsharded shape), on the CPU: norm weights
        1, other vectors 0, matrices N(0, 0.02) with residual projections scaled by 1/sqrt(2·layers)
        (GPT-2). Drawn from a generator seeded by (seed, name) alone, so a parameter's value depends
        neither on the other parameters, nor on the world size, nor on how the model is sharded."""
        if len(shape) == 1:  # norm weights and biases
            return torch.ones(shape, dtype=dtype) if name.endswith("norm.weight") else torch.zeros(shape, dtype=dtype)
        std = 0.02 / math.sqrt(2 * self.args.n_layers) if name.endswith(self.residual_suffixes) else 0.02
        gen = torch.Generator(device="cpu")
        gen.manual_seed(param_seed(0 if seed is None else seed, name))
        return torch.empty(shape, dtype=dtype).normal_(0.0, std, generator=gen)

    def init_weights(self, seed: int | None = None) -> None:
        """Deterministic init of every (materialised) parameter from ``initial_value``, and the buffers."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.device.type != "meta":
                    p.copy_(self.initial_value(name, p.shape, p.dtype, seed))
        self.init_buffers()

    def init_buffers(self) -> None:
        """Recompute the non-persistent buffers (RoPE tables) in place, e.g. after ``to_empty``."""
        if self.rope is not None and self.rope.device.type != "meta":
            with torch.no_grad():
                self.rope.copy_(rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.args.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds model.max_seq_len={self.args.max_seq_len}")
        h = embed(self, tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        return self.output(self.norm(h))


def param_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from the run's seed and a parameter's name (stable across processes)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def count_params(model: nn.Module) -> int:
    """Unique parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
