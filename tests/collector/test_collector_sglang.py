"""SGLang's request traces (a request root with stage slices under its thread spans, from
tests/data/sglang, built from SGLang's documented span names) become `requests` rows as vLLM's do."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "sglang" / "request_traces.json"
BASE_NS = 1_750_000_000_000_000_000  # the fixture's time origin


def shifted(doc: dict, to_ns: int) -> dict:
    """The fixture with its times moved to start at `to_ns`."""
    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                for key in ("startTimeUnixNano", "endTimeUnixNano"):
                    span[key] = str(int(span[key]) - BASE_NS + to_ns)
    return doc


def test_sglang_request_traces_map_into_requests(start_collector) -> None:
    c = start_collector("--assemble-grace-s", "0.5")
    doc = shifted(json.loads(FIXTURE.read_text()), time.time_ns() - 10 * 1_000_000_000)
    r = httpx.post(f"{c.url}/v1/traces", json=doc, timeout=30)
    assert r.status_code == 200, r.text
    c.wait_count("SELECT count() FROM requests WHERE service = 'sglang'", 3)
    time.sleep(2.5)  # another pass of the assembler adds nothing
    rows = c.sql(
        "SELECT role, request_id, e2e_s, ttft_s, queue_s, prefill_s, decode_s, kv_transfer_s, instance "
        "FROM requests WHERE service = 'sglang' ORDER BY role"
    ).json()["rows"]
    by_role = {row[0]: row[1:] for row in rows}
    assert len(rows) == 3
    rid, e2e, ttft, queue, prefill, decode, kv, instance = by_role["colocated"]
    assert rid == "3f2a9c1d7e6b4a5f8c9d0e1f2a3b4c5d" and instance == "sglang-0"
    assert (e2e, ttft, queue, prefill, decode, kv) == pytest.approx((1.85, 0.336, 0.12, 0.21, 1.512, 0.0))
    _, e2e, ttft, queue, prefill, decode, kv, _ = by_role["prefill"]
    assert (ttft, queue, prefill, kv) == pytest.approx((0.5, 0.06, 0.4, 0.239))
    assert decode is None
    _, e2e, ttft, queue, prefill, decode, kv, _ = by_role["decode"]
    assert (e2e, queue, decode, kv) == pytest.approx((3.0, 0.66, 2.268, 0.068))
    assert ttft is None and prefill is None


def test_assembler_waits_only_for_groups_with_sglang_roots() -> None:
    import pyarrow as pa

    from collector.sglang import has_roots

    assert not has_roots(pa.table({"SpanName": ["llm_request", "engine.step", "Request queued"]}))
    assert has_roots(pa.table({"SpanName": ["engine.step", "prefill Req 3f2a9c1d"]}))
