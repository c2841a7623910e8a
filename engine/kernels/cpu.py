"""What the CPU under the engine is: its model name, the cores this process may use, and the vector and
matrix instruction sets the kernels care about (Linux `/proc/cpuinfo`; elsewhere what `platform` says)."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

# The instruction sets that decide which kernels run fastest, in the kernel's terms: AVX2 + FMA (8 floats
# a vector), AVX-512 (16), AMX (bf16/int8 tiles, used by oneDNN for those dtypes).
ISA_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


@dataclass(frozen=True, slots=True)
class CpuInfo:
    model: str  # "AMD EPYC 7B13", "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    cores: int  # logical CPUs this process may run on
    isa: tuple[str, ...]  # the ISA_FLAGS the CPU reports, in that order

    @property
    def vector_isa(self) -> str:
        """The widest float32 FMA vector unit: "avx512", "avx2" or "baseline"."""
        if "avx512f" in self.isa:
            return "avx512"
        if "avx2" in self.isa and "fma" in self.isa:
            return "avx2"
        return "baseline"

    @property
    def kernel_isa(self) -> str:
        """The vector unit the native kernels are built for: `vector_isa`, lowered to
        `$STEPSCOPE_KERNEL_ISA` when that names a narrower one (see `kernel_isa_cap`)."""
        cap = kernel_isa_cap()
        if cap == "native" or VECTOR_ISAS.index(cap) >= VECTOR_ISAS.index(self.vector_isa):
            return self.vector_isa
        return cap


# Vector units from the narrowest, and the compiler flags that keep `-march=native` code within each: a
# fleet built for its oldest CPUs, or an AVX2 kernel measured on an AVX-512 machine.
VECTOR_ISAS = ("baseline", "avx2", "avx512")
KERNEL_ISA_FLAGS = {"native": [], "avx512": [], "avx2": ["-mno-avx512f"], "baseline": ["-mno-avx"]}
KERNEL_ISA_ENV = "STEPSCOPE_KERNEL_ISA"


def kernel_isa_cap() -> str:
    """`$STEPSCOPE_KERNEL_ISA`: "native" (the default: the widest unit the CPU has), "avx512", "avx2" or
    "baseline" (SSE, 4 lanes). RuntimeError naming the choices for any other value."""
    cap = os.environ.get(KERNEL_ISA_ENV, "native").strip().lower() or "native"
    if cap not in KERNEL_ISA_FLAGS:
        raise RuntimeError(f"{KERNEL_ISA_ENV}={cap!r}: expected one of {', '.join(KERNEL_ISA_FLAGS)}")
    return cap


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuInfo:
    """This machine's CPU (the first processor's entry: the cores of one machine share one model)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return CpuInfo(platform.processor() or platform.machine(), cores, ())
    fields: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    model = fields.get("model name") or platform.processor() or platform.machine()
    return CpuInfo(model, cores, tuple(f for f in ISA_FLAGS if f in flags))
