"""The native decode kernel: built once per machine, refused layouts change nothing, and an engine
without a C compiler still serves (on the torch path)."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import kernels
from engine.attention import make_attention_metadata
from engine.config import EngineConfig, SamplingParams
from engine.llm import LLM

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture
def fresh_kernels(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """No kernel loaded yet in this process, and builds going to an empty directory."""
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setenv("STEPSCOPE_KERNEL_DIR", str(tmp_path))
    return tmp_path


def test_the_library_is_built_once_into_the_kernel_dir(fresh_kernels) -> None:
    if kernels.paged_decode() is None:
        pytest.skip("no C compiler on this machine")
    built = list(fresh_kernels.glob("stepscope-kernels-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert kernels._build(kernels.SOURCES) == built[0]  # a second process finds it
    assert built[0].stat().st_mtime_ns == stamp
    assert not list(fresh_kernels.glob("*.tmp")), "no half-written file is left behind"


def test_without_a_compiler_the_engine_serves_on_the_torch_path(
    fresh_kernels, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", str(fresh_kernels / "no-such-cc"))
    with caplog.at_level(logging.WARNING, logger="engine.kernels"):
        llm = LLM(EngineConfig(model="tiny", num_threads=1))
    assert llm.core.runner.decode_kernel is None
    assert "using torch ops" in caplog.text
    reference = LLM(EngineConfig(model="tiny", num_threads=1, kernels="torch"))
    prompt = [[5, 9, 2, 7, 1, 3]]
    assert llm.generate(prompt, GREEDY)[0].token_ids == reference.generate(prompt, GREEDY)[0].token_ids


def test_a_layout_beyond_the_kernel_is_refused_and_nothing_is_written() -> None:
    kernel = kernels.paged_decode()
    if kernel is None:
        pytest.skip("no C compiler on this machine")
    assert not kernel.supports(num_heads=66, num_kv_heads=2, head_dim=16, block_size=4)  # 33 per KV head
    cache = torch.zeros(2, 4, 4, 2, 16)
    meta = make_attention_metadata([1], [3], [[2]], block_size=4)
    q, out = torch.randn(1, 66, 16), torch.empty(1, 66, 16)
    k, v = torch.randn(1, 2, 16), torch.randn(1, 2, 16)
    seqs = tokens = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="cannot take heads=66"):
        kernel(
            q, k, v, meta.slot_mapping, out, cache, meta.block_tables, meta.seq_lens, None, seqs, tokens, 0.25
        )
    assert not cache.any()
    with pytest.raises(ValueError, match="q must be float32"):
        kernel.check(q.bfloat16(), k, v, cache, (meta.slot_mapping, meta.block_tables))
    with pytest.raises(ValueError, match="index tensors"):
        kernel.check(q, k, v, cache, (meta.slot_mapping.int(),))


def test_the_model_runner_picks_the_kernel_only_where_it_applies() -> None:
    if kernels.paged_decode() is None:
        pytest.skip("no C compiler on this machine")
    assert LLM(EngineConfig(model="tiny", num_threads=1)).core.runner.decode_kernel is not None
    for off in ({"kernels": "torch"}, {"kv_dtype": "int8"}, {"dtype": "bf16"}):
        llm = LLM(EngineConfig(model="tiny", num_threads=1, **off))
        assert llm.core.runner.decode_kernel is None, off


def test_silu_mul_matches_torch_across_the_range_of_exp() -> None:
    ops = kernels.fused_ops()
    if ops is None:
        pytest.skip("no C compiler on this machine")
    gate = torch.linspace(-120.0, 120.0, 4001)  # past expf's overflow at |x| > 88.4, and every lane position
    up = torch.randn(4001)
    gate_up = torch.cat([gate, up]).reshape(1, -1)
    out = ops.silu_mul(gate_up)[0]
    assert out.isfinite().all()
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-30)


def test_the_cpu_is_described_by_model_cores_and_instruction_sets(tmp_path) -> None:
    from engine.kernels.cpu import cpu_info

    cpuinfo = tmp_path / "cpuinfo"
    flags = "fpu sse4_2 avx avx2 fma avx512f avx512bw amx_tile amx_bf16"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: Intel Xeon\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    info = cpu_info(cpuinfo)
    assert info.model == "Intel Xeon" and info.cores >= 1
    assert info.isa == ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "amx_tile", "amx_bf16")
    assert info.vector_isa == "avx512"
    cpuinfo.write_text("model name\t: AMD EPYC\nflags\t\t: sse4_2 avx avx2 fma\n")
    assert cpu_info(cpuinfo).vector_isa == "avx2"
    assert cpu_info(tmp_path / "absent").isa == ()


PANEL_WIDTH = {"avx512": 32, "avx2": 16, "baseline": 8}  # two vectors of float32 per panel


@pytest.mark.parametrize("cap", ["avx2", "baseline"])
def test_the_kernels_can_be_held_to_a_narrower_vector_unit(
    fresh_kernels, monkeypatch: pytest.MonkeyPatch, cap: str
) -> None:
    from engine.kernels.cpu import VECTOR_ISAS, cpu_info

    if VECTOR_ISAS.index(cpu_info().vector_isa) < VECTOR_ISAS.index(cap):
        # a cap never raises the CPU's own unit, so there is no narrower build to check here
        pytest.skip(f"this CPU has no {cap}")
    monkeypatch.setenv("STEPSCOPE_KERNEL_ISA", cap)
    kernel = kernels.linear()
    if kernel is None:  # the native library needs the system C compiler; the torch path is tested apart
        pytest.skip("no C compiler on this machine")
    assert cpu_info().kernel_isa == cap
    assert kernel.panel_width == PANEL_WIDTH[cap]
    weight, bias, x = torch.randn(70, 96), torch.randn(70), torch.randn(5, 96)
    torch.testing.assert_close(
        kernel(x, kernel.panels(weight), bias, 70), torch.nn.functional.linear(x, weight, bias)
    )
    llm = LLM(EngineConfig(model="tiny", num_threads=1))
    reference = LLM(EngineConfig(model="tiny", num_threads=1, kernels="torch"))
    prompt = [[5, 9, 2, 7, 1, 3]]
    assert llm.generate(prompt, GREEDY)[0].token_ids == reference.generate(prompt, GREEDY)[0].token_ids


def test_an_unknown_kernel_isa_is_named_and_the_engine_serves_on_the_torch_path(
    fresh_kernels, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("STEPSCOPE_KERNEL_ISA", "avx1024")
    with caplog.at_level(logging.WARNING, logger="engine.kernels"):
        llm = LLM(EngineConfig(model="tiny", num_threads=1))
    assert llm.core.runner.decode_kernel is None
    assert "STEPSCOPE_KERNEL_ISA='avx1024': expected one of native, avx512, avx2, baseline" in caplog.text
    assert not list(fresh_kernels.iterdir()), "nothing is built"


def test_a_kernel_isa_cap_never_raises_the_cpu_s_own(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.kernels.cpu import cpu_info

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("model name\t: AMD EPYC\nflags\t\t: sse4_2 avx avx2 fma\n")
    monkeypatch.setenv("STEPSCOPE_KERNEL_ISA", "avx512")
    assert cpu_info(cpuinfo).kernel_isa == "avx2"
    monkeypatch.setenv("STEPSCOPE_KERNEL_ISA", "baseline")
    assert cpu_info(cpuinfo).kernel_isa == "baseline"
    monkeypatch.delenv("STEPSCOPE_KERNEL_ISA")
    assert cpu_info(cpuinfo).kernel_isa == "avx2"
