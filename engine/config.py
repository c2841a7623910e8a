"""Every engine default lives here. The CLI and the HTTP API are built from these dataclasses."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Literal

# Byte-level tokenizer ids (engine/tokenizer.py): 0..255 are bytes, then the specials.
BYTE_BOS_ID = 256
BYTE_EOS_ID = 257
BYTE_PAD_ID = 258


@dataclass(slots=True)
class ModelConfig:
    """Shape of a Llama-architecture decoder (also covers Qwen2: `attention_bias`)."""

    name: str = "tiny"
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 172
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    max_model_len: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = BYTE_BOS_ID
    eos_token_id: int | None = BYTE_EOS_ID
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        for f in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "head_dim",
            "max_model_len",
        ):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1")


# Named presets with seeded random weights. `tiny` keeps a CPU step in a few ms for tests;
# `small` and `bench` are big enough that decode is memory-bound on a CPU (weights far larger than cache).
# `bench` has TinyLlama-1.1B's widths and vocabulary with 4 of its 22 layers (1.2 GB in fp32): the matmul
# shapes of a real small LLM (int8 kernels are compute-bound at K=1024, narrower than any real LLM).
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(name="tiny"),
    "small": ModelConfig(
        name="small",
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        max_model_len=4096,
    ),
    "bench": ModelConfig(
        name="bench",
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_layers=4,
        num_heads=32,
        num_kv_heads=4,
        head_dim=64,
        max_model_len=4096,
    ),
}


def preset(name: str) -> ModelConfig:
    """A fresh copy of a named preset (callers may change fields without touching the table)."""
    if name not in PRESETS:
        raise ValueError(
            f"unknown model preset {name!r}; choose one of {sorted(PRESETS)} or a checkpoint path"
        )
    return dataclasses.replace(PRESETS[name])


SchedulingMode = Literal["continuous", "static"]
WeightDtype = Literal["auto", "fp32", "bf16", "fp16", "int8"]
KVDtype = Literal["auto", "int8"]
Kernels = Literal["auto", "torch"]


@dataclass(slots=True)
class EngineConfig:
    """Engine knobs. Field metadata `help` feeds the CLI; `runtime=True`: the admin API may change it."""

    model: str = field(
        default="tiny", metadata={"help": "preset name (tiny|small|bench) or a HF checkpoint dir"}
    )
    device: str = field(default="auto", metadata={"help": "auto|cpu|cuda|cuda:N"})
    dtype: str = field(default="auto", metadata={"help": "auto (fp32 on CPU, bf16 on CUDA)|fp32|bf16|fp16"})
    weight_dtype: WeightDtype = field(
        default="auto",
        metadata={"help": "linear-layer weights: auto (the model dtype), a float dtype, or int8 per channel"},
    )
    kv_dtype: KVDtype = field(
        default="auto",
        metadata={"help": "KV cache: auto (the model dtype) or int8 per token and head (~2x the tokens)"},
    )
    kernels: Kernels = field(
        default="auto",
        metadata={
            "help": "auto: native CPU kernels for float32 on the CPU (decode attention read in place from "
            "the paged cache; fused residual+RMSNorm, rotary, SiLU*up), built on first use with the C "
            "compiler, else torch; torch: torch ops everywhere"
        },
    )
    weight_packing: bool = field(
        default=True,
        metadata={
            "help": "float32 on the CPU: reorder each weight once at load, into the native kernel's panels "
            "(--kernels auto) or else oneDNN's layout (1.2-1.7x on decode batches; keeps a second copy of "
            "the weights)"
        },
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV-cache block"})
    num_kv_blocks: int = field(
        default=0,
        metadata={"help": "KV blocks in the pool (0: sized from --kv-cache-bytes)", "runtime": True},
    )
    kv_cache_bytes: int = field(
        default=256 * 2**20, metadata={"help": "KV-cache budget when num_kv_blocks is 0"}
    )
    max_num_seqs: int = field(default=32, metadata={"help": "most sequences in one step", "runtime": True})
    max_num_batched_tokens: int = field(
        default=512, metadata={"help": "most tokens (prefill+decode) in one step", "runtime": True}
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata={"help": "split long prompts across steps", "runtime": True}
    )
    enable_prefix_caching: bool = field(
        default=True, metadata={"help": "share full prompt blocks across requests"}
    )
    long_prefill_token_threshold: int = field(
        default=0,
        metadata={
            "help": "cap on one prompt's chunk per step so long prompts cannot starve short ones (0: auto)"
        },
    )
    scheduling: SchedulingMode = field(
        default="continuous", metadata={"help": "continuous (step-level) or static (fixed padded batches)"}
    )
    max_waiting: int = field(
        default=1024, metadata={"help": "bounded waiting queue; beyond it requests get 429"}
    )
    num_threads: int = field(default=0, metadata={"help": "torch CPU threads (0: all cores)"})
    seed: int = field(default=0, metadata={"help": "seed for random preset weights"})

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.scheduling not in ("continuous", "static"):
            raise ValueError(f"scheduling must be continuous or static, got {self.scheduling!r}")
        for name, kind in (
            ("weight_dtype", WeightDtype),
            ("kv_dtype", KVDtype),
            ("kernels", Kernels),
        ):
            value, choices = getattr(self, name), typing.get_args(kind)
            if value not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
        if self.num_kv_blocks < 0 or self.kv_cache_bytes < 0:
            raise ValueError("num_kv_blocks and kv_cache_bytes must be >= 0")

    @staticmethod
    def runtime_fields() -> list[str]:
        return [f.name for f in dataclasses.fields(EngineConfig) if f.metadata.get("runtime")]


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling. temperature 0 is greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError("max_tokens must be an integer >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
