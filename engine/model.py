"""A Llama-architecture decoder (Llama, Mistral, Qwen2) over a flattened varlen batch and a paged KV cache.

Module and parameter names follow Hugging Face's `LlamaForCausalLM`, except that q/k/v live in one
`qkv_proj` and gate/up in one `gate_up_proj` (one matmul instead of three or two at decode time, where
each matmul is a full pass over its weights); engine/loader.py concatenates HF weights to match.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.config import ModelConfig
from engine.kernels import FusedOps
from engine.kv_cache import KVCache

# Random-weight init (presets). Linear weights use INIT_STD; the embedding and the LM head use a
# larger std so that a token's own embedding does not drown the attention and MLP contributions
# in the residual stream relative to the LM head, which would make greedy decoding loop on one token.
INIT_STD = 0.02
EMBED_INIT_STD = 1.0
LM_HEAD_INIT_STD = 0.5


class RMSNorm(nn.Module):
    """Root-mean-square norm (HF's LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op (about half the time of the unfused form at decode); same result in float32.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_model_len, HF's rotate_half convention."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta = head_dim, max_positions, theta
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        self.reset_tables()

    @torch.no_grad()
    def reset_tables(self) -> None:
        """(Re)compute the tables on the buffers' device and dtype (needed after `to_empty()` from meta)."""
        if self.cos.device.type == "meta":
            return
        # float32 on the CPU like HF (positions x inv_freq is one rounding either way), then cast.
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        inv_freq = 1.0 / (self.theta**exponent)  # [Dh / 2]
        positions = torch.arange(self.max_positions, dtype=torch.int64).float()
        freqs = torch.outer(positions, inv_freq)  # [P, Dh / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, Dh]
        self.cos.copy_(emb.cos())
        self.sin.copy_(emb.sin())

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, Dh] (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, Dh], cos/sin [T, 1, Dh] -> rotated x."""
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Grouped-query self-attention with a fused q/k/v projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x [T, D] -> [T, D]; writes this step's K/V into `kv_cache`."""
        tokens, qk_size = x.shape[0], self.q_size + self.kv_size
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) Dh]
        # q and k rotate in one pass: half the small ops, which add up at batch 1
        qk = apply_rotary(qkv[:, :qk_size].view(tokens, -1, self.head_dim), cos, sin)  # [T, H + Hkv, Dh]
        v = qkv[:, qk_size:].view(tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, Dh]
        return self._attend(qk, v, kv_cache, meta)

    def forward_fused(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        ops: FusedOps,
    ) -> torch.Tensor:
        """`forward` with q and k rotated in place by one native call (float32 CPU)."""
        tokens, qk_size = x.shape[0], self.q_size + self.kv_size
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) Dh]
        ops.rotary_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, rotary.cos, rotary.sin, positions)
        qk = qkv[:, :qk_size].view(tokens, -1, self.head_dim)  # [T, H + Hkv, Dh], rotated
        v = qkv[:, qk_size:].view(tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, Dh]
        return self._attend(qk, v, kv_cache, meta)

    def _attend(
        self, qk: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Rotated q and k [T, H + Hkv, Dh], v [T, Hkv, Dh] -> the attention block's output [T, D]."""
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]  # [T, H, Dh], [T, Hkv, Dh]
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)  # [T, H, Dh]
        return self.o_proj(out.reshape(qk.shape[0], self.q_size))


class MLP(nn.Module):
    """SwiGLU feed-forward with a fused gate/up projection: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm (HF's `model.` prefix)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama-architecture decoder over a flattened batch of sequences and a paged KV cache.

    `forward` returns hidden states; `compute_logits` applies the LM head only to the rows the
    caller samples from (the last token of each sequence), which saves a [T, V] matmul in prefill.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        # Native float32 CPU ops between the matmuls (engine/kernels), set by the model runner; None: torch.
        self.fused: FusedOps | None = None
        self.model = LlamaModel(cfg)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_model_len, cfg.rope_theta)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when the config says so."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T] long -> hidden [T, D]. Writes each new token's K/V into `kv_caches`."""
        if self.fused is not None:
            return self._forward_fused(input_ids, positions, kv_caches, meta, self.fused)
        x = self.model.embed_tokens(input_ids)  # [T, D]
        cos, sin = self.rotary(positions)  # [T, 1, Dh] each
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.model.norm(x)

    def _forward_fused(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        ops: FusedOps,
    ) -> torch.Tensor:
        """`forward` with the residual stream kept in one tensor and updated in place: each residual add
        is fused with the norm after it (the next layer's input norm, or the final one)."""
        layers = self.model.layers
        x = self.model.embed_tokens(input_ids)  # [T, D], a fresh tensor: the residual stream
        h = ops.add_rms_norm(x, None, *_norm_args(layers[0].input_layernorm))
        next_norms = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
        for layer, next_norm, kv_cache in zip(layers, next_norms, kv_caches, strict=True):
            attn = layer.self_attn.forward_fused(h, positions, self.rotary, kv_cache, meta, ops)
            h = ops.add_rms_norm(x, attn, *_norm_args(layer.post_attention_layernorm))
            mlp = layer.mlp.down_proj(ops.silu_mul(layer.mlp.gate_up_proj(h)))
            h = ops.add_rms_norm(x, mlp, *_norm_args(next_norm))
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, D] -> logits [N, V] float32."""
        return self.lm_head(hidden).float()


def _norm_args(norm: RMSNorm) -> tuple[torch.Tensor, float]:
    return norm.weight, norm.eps


def build_model(cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> LlamaForCausalLM:
    """A model with random weights seeded by `cfg.seed`: the same weights in every process and device.

    Weights are drawn on the CPU in float32 from a private generator (the global RNG is untouched),
    then moved and cast.
    """
    model = LlamaForCausalLM(cfg)
    generator = torch.Generator(device="cpu").manual_seed(cfg.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # registration order: deterministic
            _init_param(name, param, generator)
    model = model.to(device=device, dtype=dtype)
    model.rotary.reset_tables()  # recompute in float32 before the cast, like the loader
    return model.eval()


def _init_param(name: str, param: nn.Parameter, generator: torch.Generator) -> None:
    if name.endswith("norm.weight"):
        param.fill_(1.0)
    elif name.endswith(".bias"):
        param.normal_(0.0, INIT_STD, generator=generator)
    elif name == "model.embed_tokens.weight":
        param.normal_(0.0, EMBED_INIT_STD, generator=generator)
    elif name == "lm_head.weight":
        param.normal_(0.0, LM_HEAD_INIT_STD, generator=generator)
    else:
        param.normal_(0.0, INIT_STD, generator=generator)
