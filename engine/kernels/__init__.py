"""Native CPU kernels, compiled on first use with the system C compiler and called through ctypes.

- `paged_decode.c`: decode attention read in place from a float32 paged KV cache. The torch path
  (engine/attention.py) copies each decode's context out of its blocks into a padded buffer and then runs
  SDPA over it; that copy was about a fifth of a batch-32 step on the `small` preset.
- `fused_ops.c`: the small ops between a layer's matmuls (residual add + RMSNorm, rotary, SiLU * up), one
  call each instead of several torch ops, which at batch 1 cost more than the arithmetic.
- `linear.c`: float32 linears for the few rows of a decode step, each weight streamed once in its own
  row-major layout (engine/packed.py picks it by row count and CPU features).

Both sources build into one shared library, once per source, compiler flags and CPU (`-march=native`,
held to a narrower vector unit by `$STEPSCOPE_KERNEL_ISA`: `cpu.kernel_isa_cap`), in
`$STEPSCOPE_KERNEL_DIR` (default `~/.cache/stepscope/kernels`), by an atomic rename, so concurrent
processes never load a half-written file. `-fopenmp` makes it use the OpenMP runtime torch has already
loaded (the same `libgomp.so.1` soname), so its threads are torch's threads and `torch.set_num_threads`
applies. Without a compiler, or if the build fails, `paged_decode()` and `fused_ops()` return None (one
warning) and the engine stays on torch ops.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import subprocess
from pathlib import Path

import torch

from engine.kernels.cpu import KERNEL_ISA_FLAGS, kernel_isa_cap
from stepscope.native import build_library

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name) for name in ("paged_decode.c", "fused_ops.c", "linear.c")]
HEADERS = [Path(__file__).with_name("vec.h")]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno"]
BUILD_TIMEOUT_S = 120

_loaded: dict[str, ctypes.CDLL | None] = {}


# The kernel's fixed scratch (paged_decode.c): query heads per KV head, head dim, tokens per block.
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK_SIZE = 32, 256, 256


class PagedDecodeKernel:
    """`paged_decode_f32` from the compiled library, with its argument types declared."""

    @staticmethod
    def supports(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
        """Whether the kernel takes this attention layout (else the caller keeps the torch path)."""
        group, rest = divmod(num_heads, num_kv_heads)
        return rest == 0 and group <= MAX_GROUP and head_dim <= MAX_HEAD_DIM and block_size <= MAX_BLOCK_SIZE

    def __init__(self, library: ctypes.CDLL) -> None:
        fn = library.paged_decode_f32
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        # q, stride, out, stride, cache, blocks, block size, kv heads, head dim, heads; tables, stride,
        # seq_lens, key_starts, seqs, tokens, decodes, scale; k, stride, v, stride, slots, tokens
        head = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64]
        decodes = [ptr, i64, ptr, ptr, ptr, ptr, i64, ctypes.c_float]
        fn.argtypes = head + decodes + [ptr, i64, ptr, i64, ptr, i64]
        fn.restype = ctypes.c_int
        self._fn = fn

    @staticmethod
    def check(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        index_tensors: tuple[torch.Tensor | None, ...],
    ) -> None:
        """Raise ValueError unless the tensors have the layouts the kernel reads through raw pointers. The
        layouts are the same in every layer of a step, so callers check once per step, not per call."""
        head_dim = kv_cache.shape[-1]
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dtype != torch.float32 or t.stride(2) != 1 or t.stride(1) != head_dim:
                raise ValueError(f"{name} must be float32 [T, heads, Dh] with contiguous heads")
        if kv_cache.dtype != torch.float32 or not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be a contiguous float32 tensor")
        if any(t is not None and (t.dtype != torch.int64 or not t.is_contiguous()) for t in index_tensors):
            raise ValueError("index tensors must be contiguous int64")

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
        out: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        key_starts: torch.Tensor | None,
        seqs: torch.Tensor,
        tokens: torch.Tensor,
        scale: float,
    ) -> None:
        """Write k, v [T, Hkv, Dh] to their `slot_mapping` slots of kv_cache [2, NB, BS, Hkv, Dh], then
        attend decode i (sequence `seqs[i]`, token row `tokens[i]` of q [T, H, Dh]) into the same row of
        `out` (contiguous, like q); all float32, layouts as `check` wants them. Raises ValueError, having
        changed nothing, on a head layout beyond the kernel's scratch (`supports`)."""
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        num_heads = q.shape[1]
        status = self._fn(
            q.data_ptr(),
            q.stride(0),
            out.data_ptr(),
            out.stride(0),
            kv_cache.data_ptr(),
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
            num_heads,
            block_tables.data_ptr(),
            block_tables.stride(0),
            seq_lens.data_ptr(),
            None if key_starts is None else key_starts.data_ptr(),
            seqs.data_ptr(),
            tokens.data_ptr(),
            seqs.shape[0],
            scale,
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            slot_mapping.data_ptr(),
            slot_mapping.shape[0],
        )
        if status == -2:
            raise MemoryError("paged_decode kernel: no memory for its span scratch")
        if status != 0:
            raise ValueError(
                f"paged_decode kernel cannot take heads={num_heads} kv_heads={num_kv_heads} "
                f"head_dim={head_dim} block_size={block_size}"
            )


def library() -> ctypes.CDLL | None:
    """The compiled library, built on first use; None (logged once) where it cannot be built here."""
    if "library" not in _loaded:
        try:
            _loaded["library"] = ctypes.CDLL(str(_build(SOURCES)))
        except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
            log.warning("native CPU kernels unavailable, using torch ops: %s", exc)
            _loaded["library"] = None
    return _loaded["library"]


def paged_decode() -> PagedDecodeKernel | None:
    """The decode-attention kernel, or None where the library cannot be built here."""
    lib = library()
    return None if lib is None else PagedDecodeKernel(lib)


def fused_ops() -> FusedOps | None:
    """The fused small ops, or None where the library cannot be built here."""
    lib = library()
    return None if lib is None else FusedOps(lib)


def linear() -> LinearKernel | None:
    """The small-batch linear kernel, or None where the library cannot be built here."""
    lib = library()
    return None if lib is None else LinearKernel(lib)


class LinearKernel:
    """`linear_f32` (linear.c): x [rows, K] times a weight reordered by `panels`, float32."""

    def __init__(self, library: ctypes.CDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._fn = library.linear_f32
        self._fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64]
        self._fn.restype = None
        library.linear_panel_width.restype = i64
        # output features a panel holds: two vectors, so 32 with AVX-512, 16 with AVX2 (-march=native)
        self.panel_width: int = library.linear_panel_width()

    def panels(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [N, K] -> [ceil(N / width), K, width] contiguous float32, the last panel zero-padded."""
        n, k = weight.shape
        padded = torch.nn.functional.pad(weight.detach().float(), (0, 0, 0, -n % self.panel_width))
        return padded.view(-1, self.panel_width, k).transpose(1, 2).contiguous()

    def __call__(
        self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int
    ) -> torch.Tensor:
        """x [rows, K] float32 (rows contiguous) -> [rows, n]; `bias` [n] contiguous float32 or None."""
        rows, k = x.shape
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty(rows, n, dtype=x.dtype)
        bias_ptr = None if bias is None else bias.data_ptr()
        self._fn(x.data_ptr(), rows, x.stride(0), panels.data_ptr(), bias_ptr, out.data_ptr(), n, n, k)
        return out


class FusedOps:
    """`fused_ops.c`: float32, contiguous CPU tensors (the caller's contract; checked only by shape)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        self._add_rms_norm = library.add_rms_norm_f32
        self._add_rms_norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, f32]
        self._add_rms_norm.restype = None
        self._silu_mul = library.silu_mul_f32
        self._silu_mul.argtypes = [ptr, ptr, i64, i64]
        self._silu_mul.restype = None
        self._rotary = library.rotary_f32
        self._rotary.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr]
        self._rotary.restype = None

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += delta (in place, when given); returns rms_norm(residual) * weight. [rows, dim]."""
        rows, dim = residual.shape
        assert residual.is_contiguous() and (delta is None or delta.shape == residual.shape)
        if delta is not None and not delta.is_contiguous():
            delta = delta.contiguous()
        out = torch.empty_like(residual)
        delta_ptr = None if delta is None else delta.data_ptr()
        self._add_rms_norm(residual.data_ptr(), delta_ptr, weight.data_ptr(), out.data_ptr(), rows, dim, eps)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [rows, 2 I] -> silu(gate) * up [rows, I]."""
        rows, width = gate_up.shape
        assert gate_up.is_contiguous()
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
        return out

    def rotary_(
        self,
        x: torch.Tensor,
        heads: int,
        head_dim: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """Rotate the first `heads` heads of each row of x [rows, >= heads * head_dim] in place, at
        `positions` [rows] int64 of the cos/sin tables [max_positions, head_dim]."""
        assert x.stride(1) == 1 and positions.dtype == torch.int64 and positions.is_contiguous()
        self._rotary(
            x.data_ptr(),
            x.shape[0],
            x.stride(0),
            heads,
            head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
            positions.data_ptr(),
        )


def _build(sources: list[Path]) -> Path:
    """Compile `sources` into one shared library (once per sources, the headers they share, flags,
    compiler and CPU); its path."""
    key = _cpu_fingerprint() + b"".join(h.read_bytes() for h in HEADERS)
    flags = FLAGS + KERNEL_ISA_FLAGS[kernel_isa_cap()]
    return build_library("stepscope-kernels", sources, flags, BUILD_TIMEOUT_S, key)


def _cpu_fingerprint() -> bytes:
    """What `-march=native` depends on: the CPU model and its feature flags (Linux), else the platform."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor().encode() + platform.machine().encode()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.startswith(wanted)})).encode()
