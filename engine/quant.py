"""Int8 quantization: weights per output channel, the KV cache per token and head, both symmetric.

Pure tensor helpers plus a swap of `nn.Linear` modules (as gpt-fast does it):

    w [N, K] float  ->  w_int8 [N, K], scales [N]        w ~= w_int8 * scales[:, None]
    k [T, Hkv, Dh]  ->  k_int8 [T, Hkv, Dh], scales [T, Hkv]

Scales are rounded to bfloat16 *before* quantizing, so the bf16 scales the CPU kernel takes are
exactly the scales the int8 values were made with (no per-channel gain error from the rounding).
Values are clamped to [-127, 127]: symmetric, -128 unused.

Kernels, chosen at run time by the activation's device and row count (`int8_matmul`):
- CPU with fbgemm (x86), at most `DYNAMIC_MAX_ROWS` rows (decode steps): `quantized::linear_dynamic`,
  int8 activations (quantized per call: one asymmetric uint8 scale over the rows) times the int8 weights,
  int32 accumulation, fp32 out. Integer multiply-adds run at several times the fp32 rate on AVX2, so the
  weight read stays the bottleneck: 3-4x fp32 on decode shapes, where `_weight_int8pack_mm` (bf16
  arithmetic, emulated on AVX2) was compute-bound at 1.0-1.6x. fbgemm takes its own packed copy of the
  weight (`pack_dynamic`, kept beside `weight`: the int8 bytes twice in memory, read once per step).
- CPU, otherwise up to `DECODE_MAX_ROWS` rows: `torch._weight_int8pack_mm(x_bf16, w_int8, scales_bf16)`,
  weights-only int8, activations cast to bf16 and back (fp32 activations into this op are several times
  slower), K a multiple of `PACK_K_MULTIPLE` only.
- Longer prefill chunks, and CUDA (and anything else): dequantize on the fly,
  `F.linear(x, w_int8.to(x.dtype)) * scales`, the gpt-fast formulation that torch.compile fuses into one
  kernel on a GPU. Not measured on a GPU (none here).

What is quantized: every `nn.Linear` (fused qkv and gate_up as single matrices, and the LM head unless
it is tied to the embedding, which stays full precision with it). Embeddings and norms are untouched.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.device import resolve_dtype

INT8_MAX = 127
SCALE_DTYPE = torch.bfloat16  # weight and KV scales: 2 bytes, and what the CPU kernel takes
_MIN_SCALE = 1e-10  # an all-zero row or token gets this scale (its int8 values are all 0)
# torch 2.13's CPU `_weight_int8pack_mm` returns garbage or crashes unless K is a multiple of 16 (seen
# with K = 8, 24, 40, 100, 172 on AVX2); 64 leaves a margin for wider vector units. Other K: dequantize.
PACK_K_MULTIPLE = 64
# fbgemm's one activation scale per call spans all the rows: fine for a decode batch (one token from each
# sequence), coarse over a prompt chunk, where one loud token (a trained model's first) sets the scale for
# all. On `bench`, teacher-forced greedy agreement with fp32: 0.93 fed a token at a time, 0.89 in chunks of
# 64, 0.96 weights-only. So: decode batches up to the default max_num_seqs, not chunks.
DYNAMIC_MAX_ROWS = 32
# The bf16 packed kernel wins while the matmul is memory-bound; on long prefill chunks its emulated bf16
# arithmetic loses to dequantize-then-fp32-matmul. Crossover measured at 64-128 rows.
DECODE_MAX_ROWS = 64


def _cpu_has_vnni() -> bool:
    """Whether the CPU multiplies u8 x s8 into int32 directly (AVX-512 VNNI or AVX-VNNI).

    Without it fbgemm adds u8 x s8 pairs in saturating int16 (vpmaddubsw): full-range uint8 activations
    overflow (seen on AVX2 EPYC: errors of 13% of the output's range). `reduce_range` keeps activations to
    7 bits there, which cannot overflow.
    """
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(re.search(r"\b(avx512_vnni|avx_vnni|amx_int8)\b", text))


REDUCE_RANGE = not _cpu_has_vnni()


def resolve_model_dtype(dtype: str, weight_dtype: str, device: torch.device) -> torch.dtype:
    """The model's (activation) dtype from `--dtype` and `--weight-dtype`.

    A float weight dtype with `--dtype auto` sets the model dtype; one that contradicts an explicit
    `--dtype` raises ValueError. `auto` and `int8` weights leave `--dtype` in charge.
    """
    resolved = resolve_dtype(dtype, device)
    if weight_dtype in ("auto", "int8"):
        return resolved
    wanted = resolve_dtype(weight_dtype, device)
    if dtype != "auto" and wanted != resolved:
        raise ValueError(f"weight_dtype {weight_dtype} contradicts dtype {dtype}; give one of them")
    return wanted


def symmetric_int8(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` with one scale per slice along every axis except `dim` (reduced by absmax).

    Returns (int8 values shaped like x, bf16 scales shaped like x without `dim`).
    """
    xf = x.float()
    amax = xf.abs().amax(dim=dim, keepdim=True)
    scales = (amax / INT8_MAX).clamp(min=_MIN_SCALE).to(SCALE_DTYPE)
    q = (xf / scales.float()).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales.squeeze(dim)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: w [N, K] -> (w_int8 [N, K], scales [N] bf16)."""
    return symmetric_int8(w, dim=1)


def dequantize_weight(w_int8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w_int8 [N, K], scales [N] -> w [N, K] in `dtype`."""
    return (w_int8.float() * scales.float()[:, None]).to(dtype)


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-head symmetric int8: x [T, Hkv, Dh] -> (int8 [T, Hkv, Dh], scales [T, Hkv] bf16)."""
    return symmetric_int8(x, dim=-1)


def dequantize_kv(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [..., Dh] int8, scales [...] -> [..., Dh] in `dtype` (int8 and bf16 values are exact in fp32)."""
    return (q.to(torch.float32) * scales.to(torch.float32).unsqueeze(-1)).to(dtype)


def pack_dynamic(w_int8: torch.Tensor, scales: torch.Tensor) -> torch.ScriptObject | None:
    """fbgemm's packed form of w_int8 [N, K] with its scales [N], for `quantized::linear_dynamic`.

    None where there is no such kernel: a tensor off the CPU, a quantized engine other than fbgemm's.
    """
    if w_int8.device.type != "cpu" or torch.backends.quantized.engine not in ("x86", "fbgemm"):
        return None
    zero_points = torch.zeros(w_int8.shape[0], dtype=torch.long)
    try:
        with warnings.catch_warnings():
            # torch 2.13 warns that quantized tensor *types* are deprecated (pytorch#184982); this one only
            # carries the weight into the packing and is dropped. If the ops go, the bf16 path takes over.
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch._make_per_channel_quantized_tensor(w_int8, scales.double(), zero_points, 0)
            return torch.ops.quantized.linear_prepack(qweight, None)
    except (AttributeError, RuntimeError):
        return None


def int8_matmul(
    x: torch.Tensor, w_int8: torch.Tensor, scales: torch.Tensor, packed: torch.ScriptObject | None = None
) -> torch.Tensor:
    """x [M, K] float, w_int8 [N, K], scales [N] bf16 -> [M, N] in x's dtype; the kernel by device.

    `packed` is `pack_dynamic(w_int8, scales)`, the CPU's fast path when there is one.
    """
    rows = x.shape[0]
    if x.device.type == "cpu":
        if packed is not None and rows <= DYNAMIC_MAX_ROWS:
            return torch.ops.quantized.linear_dynamic(x.float(), packed, REDUCE_RANGE).to(x.dtype)
        if rows <= DECODE_MAX_ROWS and w_int8.shape[1] % PACK_K_MULTIPLE == 0:
            return torch._weight_int8pack_mm(x.to(torch.bfloat16), w_int8, scales).to(x.dtype)
    return F.linear(x, w_int8.to(x.dtype)) * scales.to(x.dtype)


class Int8Linear(nn.Module):
    """A `nn.Linear` with per-output-channel int8 weights. Buffers, not parameters: nothing to train."""

    def __init__(self, w_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = w_int8.shape
        self.register_buffer("weight", w_int8)  # [N, K] int8
        self.register_buffer("scales", scales)  # [N] bf16
        self.register_buffer("bias", bias)  # [N] in the model dtype, or None
        self._packed: tuple[tuple, torch.ScriptObject | None] | None = None  # (made from, pack_dynamic)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """Quantize a float Linear's weight; its bias stays as it is."""
        w_int8, scales = quantize_weight(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(w_int8, scales, bias)

    def to_linear(self, dtype: torch.dtype) -> nn.Linear:
        """A float Linear with the dequantized weight (full size: what an unquantized checkpoint reads)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear = linear.to(device=self.weight.device, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(dequantize_weight(self.weight, self.scales, dtype))
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear.requires_grad_(False)

    def packed(self) -> torch.ScriptObject | None:
        """`pack_dynamic` of the current weight and scales (remade when either is replaced or changed)."""
        w, s = self.weight, self.scales
        made_from = (w, s, w._version, s._version)
        cached = self._packed
        if cached is None or cached[0][0] is not w or cached[0][1] is not s or cached[0][2:] != made_from[2:]:
            cached = self._packed = (made_from, pack_dynamic(w, s))
        return cached[1]

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "_packed": None}  # copies and pickles pack again on first use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # the CPU kernels take 2-D activations only
        packed = self.packed() if flat.device.type == "cpu" and flat.shape[0] <= DYNAMIC_MAX_ROWS else None
        out = int8_matmul(flat, self.weight, self.scales, packed)  # [M, N]
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


def quantize_model(model: nn.Module) -> dict[str, Int8Linear]:
    """Swap every `nn.Linear` of `model` for an `Int8Linear`, in place; returns the new modules by name.

    A Linear whose weight is shared with another module (the LM head tied to the embedding) is left
    alone: quantizing it would untie it and read the table twice.
    """
    shared = _shared_weight_ids(model)
    swapped: dict[str, Int8Linear] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and id(module.weight) not in shared:
            swapped[name] = Int8Linear.from_linear(module)
            swapped[name].packed()  # at load time rather than in the first decode step
            set_submodule(model, name, swapped[name])
    return swapped


def dequantize_model(model: nn.Module, dtype: torch.dtype) -> dict[str, Int8Linear]:
    """Swap every `Int8Linear` for a full-precision `nn.Linear` of its dequantized weight, in place.

    Returns the int8 modules taken out, so `restore_modules` can put exactly them back.
    """
    taken = {name: m for name, m in model.named_modules() if isinstance(m, Int8Linear)}
    for name, module in taken.items():
        set_submodule(model, name, module.to_linear(dtype))
    return taken


def restore_modules(model: nn.Module, modules: dict[str, nn.Module]) -> None:
    """Put modules back at their names (undoes `dequantize_model`)."""
    for name, module in modules.items():
        set_submodule(model, name, module)


def is_quantized(model: nn.Module) -> bool:
    """Whether any Linear of the model runs on int8 weights."""
    return any(isinstance(m, Int8Linear) for m in model.modules())


def streamed_weight_bytes(model: nn.Module, exclude: tuple[nn.Module, ...] = ()) -> int:
    """Bytes of weights a forward pass reads whole (parameters and Int8Linear buffers, each once).

    Modules in `exclude` (an untied embedding table, which a step reads only a few rows of) are left out.
    """
    skip = {id(t) for m in exclude for t in m.parameters()}
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        tensors = list(module.parameters(recurse=False))
        if isinstance(module, Int8Linear):
            tensors += [t for t in (module.weight, module.scales, module.bias) if t is not None]
        for t in tensors:
            if id(t) not in seen and id(t) not in skip:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def _shared_weight_ids(model: nn.Module) -> set[int]:
    counts: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            counts[id(p)] = counts.get(id(p), 0) + 1
    return {pid for pid, n in counts.items() if n > 1}


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` at dotted `name` in `model` (swapping Linears for int8 or packed ones)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)
