"""Device and dtype names from the config ("auto", "cuda:1", "bf16") turned into torch objects."""

from __future__ import annotations

import torch

_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def resolve_device(device: str) -> torch.device:
    """`auto` -> the first CUDA device when there is one, else the CPU; `cpu`, `cuda`, `cuda:N` as given.

    Raises ValueError for a name torch does not know or a CUDA device that is not there.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from exc
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r}; use auto, cpu, cuda or cuda:N")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {device!r} requested but only {torch.cuda.device_count()} CUDA devices exist"
            )
    return resolved


def resolve_dtype(dtype: str, device: torch.device | str) -> torch.dtype:
    """`auto` -> float32 on the CPU (bf16 matmul is emulated on CPUs without native bf16), bfloat16 on CUDA.

    Also accepts fp32|bf16|fp16 and their long names; raises ValueError otherwise.
    """
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, fp32, bf16 or fp16")
    return _DTYPES[dtype]
