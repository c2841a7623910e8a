"""Device and dtype names from the config resolve to torch objects, or fail with a clear message."""

from __future__ import annotations

import pytest
import torch

from engine.device import resolve_device, resolve_dtype


def test_auto_device_is_cuda_only_when_available() -> None:
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["gpu", "tpu", "cuda:x", ""])
def test_bad_device_names_raise_value_error(name: str) -> None:
    with pytest.raises(ValueError, match="device"):
        resolve_device(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda:0")


def test_dtype_names() -> None:
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert [resolve_dtype(n, "cpu") for n in ("fp32", "bf16", "fp16")] == [
        torch.float32,
        torch.bfloat16,
        torch.float16,
    ]
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int4", "cpu")
