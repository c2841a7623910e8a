"""Float32 linear layers on the CPU, their weights reordered once at load time (docs/engine.md).

`F.linear` hands a float32 matmul to MKL's sgemm, which re-packs the weight on every call; with a few
rows (decode batches) that packing is a large part of the call, and on AMD CPUs MKL's one-row gemv streams
the weights well below the memory's rate. Two layouts are kept instead, one per model:

- the native kernel's panels (engine/kernels/linear.c, `--kernels auto`): up to `NATIVE_LINEAR_ROWS` rows
  for the CPU's vector unit, `F.linear` above. On a 2-core AMD EPYC (AVX2), one thread: one row over the
  117 MB of `small` 6.2 ms against MKL's 9.1; 32 rows 66 GF/s against oneDNN's 56;
- oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what torch.compile's CPU freezing
  uses) where the native library does not build: 2-64 rows 1.4-1.7x `F.linear` on an AVX-512 CPU.

`PackedLinear` keeps the plain `weight` Parameter too: state dicts, the Hugging Face export, int8
quantization and the weight accounting all read it, and tied weights stay tied. That is a second copy of
each matrix in memory (the reordered one is the one read per step).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import LinearKernel
from engine.quant import set_submodule

log = logging.getLogger(__name__)

# oneDNN's reorder takes a row-count hint; 32 (the default max_num_seqs) and 512 gave the same layout
# speed from 1 to 2048 rows.
PACK_ROWS_HINT = 32


# Rows up to which the native kernel (engine/kernels/linear.c) runs a linear, by the CPU's widest float32
# vector unit; F.linear above. AVX2: measured faster than MKL and oneDNN up to 512 rows, level at 2048.
# AVX-512 (a Xeon with AMX, `small`, 2 threads, alternated): decode steps at batch 8 / 32 took 17.8 / 43.0 ms
# against 21.1 / 51.7 ms on F.linear, a 512-token prefill step 21.3 against 37.8 ms. Without AVX2 only the
# one-row stream, which is memory-bound on any CPU.
NATIVE_LINEAR_ROWS = {"avx512": 512, "avx2": 512, "baseline": 1}


def native_linear_rows(vector_isa: str) -> int:
    """How many rows at most go through the native linear kernel on a CPU with this vector unit."""
    return NATIVE_LINEAR_ROWS.get(vector_isa, 1)


class PackedLinear(nn.Linear):
    """An `nn.Linear` on the CPU in float32 whose kernel is picked per call by its row count: the native
    kernel (engine/kernels/linear.c) up to `native_max_rows`, then oneDNN with the weight reordered once
    (when packed), else `F.linear`."""

    _packed: torch.Tensor | None  # oneDNN's blocked layout
    _native: LinearKernel | None
    _panels: torch.Tensor | None  # the native kernel's layout
    native_max_rows: int

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        onednn: bool = True,
        native: LinearKernel | None = None,
        native_max_rows: int = 0,
    ) -> PackedLinear:
        """Wrap `linear`'s own weight and bias (the same Parameters: ties and state dicts unchanged)."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.in_features, module.out_features = linear.in_features, linear.out_features
        module.weight, module.bias = linear.weight, linear.bias
        weight = linear.weight.detach()
        module._packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT) if onednn else None
        module._native = native
        module._panels = None if native is None else native.panels(weight)
        module.native_max_rows = native_max_rows if native is not None else 0
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0]
        if rows <= self.native_max_rows:
            assert self._native is not None and self._panels is not None
            return self._native(x, self._panels, self.bias, self.out_features)
        if rows == 1 or self._packed is None:  # one row: MKL's gemv is as fast as oneDNN or faster
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


def packing_available() -> bool:
    """Whether this torch build can reorder and multiply through oneDNN here (float32, CPU)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight, x = torch.ones(8, 16), torch.ones(2, 16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (RuntimeError, AttributeError) as exc:
        log.warning("oneDNN weight packing unavailable, using F.linear: %s", exc)
        return False
    return bool(torch.equal(out, torch.full((2, 8), 16.0)))


def pack_model(
    model: nn.Module, onednn: bool = True, native: LinearKernel | None = None, native_max_rows: int = 0
) -> int:
    """Swap every float32 CPU `nn.Linear` of `model` for a `PackedLinear`, in place; how many. `onednn`:
    reorder each weight for oneDNN (a second copy in memory); `native`: the streaming kernel, taken up to
    `native_max_rows` rows."""
    plain = [
        (name, m)
        for name, m in model.named_modules()
        if type(m) is nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
    ]
    for name, module in plain:
        set_submodule(model, name, PackedLinear.from_linear(module, onednn, native, native_max_rows))
    return len(plain)
