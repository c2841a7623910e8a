"""The ingest path's speed-ups change costs, never rows: attributes read from their encoded bytes (with a
memo), conversion in a worker process, and insert groups that wait while batches keep coming."""

from __future__ import annotations

import time

import pytest
from test_collector_convert import _kv, _request

from collector import convert, otlp
from collector.ingest import GROUP_MIN_ROWS, IDLE_QUIET_S, LINGER_MAX_S, QUIET_S, Ingestor
from collector.spool import Spool
from collector.traces import RawTraceRequest
from collector.values import KeyValueMemo, attrs
from collector.workers import ConvertPool


def _table(batch: convert.Batch) -> list[dict]:
    return batch.tables["otel_traces"].to_pylist()


def test_encoded_attributes_read_through_the_memo_equal_attrs():
    kvs = [
        _kv("x", double_value=1e-7),
        _kv("on", bool_value=False),
        _kv("n", int_value=0),
        _kv("s", string_value=""),
        _kv("b", bytes_value=b"\x00\x01"),
        _kv("dup", int_value=1),
        _kv("dup", int_value=2),
    ]
    memo = KeyValueMemo(max_entries=3)  # smaller than the attributes: generations must turn over
    encoded = [kv.SerializeToString() for kv in kvs]
    for _ in range(3):  # cold, then from the memo
        assert memo.attrs(encoded) == attrs(kvs)
    assert len(memo._pairs) <= 3 and len(memo._old) <= 3


def test_a_payload_parsed_as_encoded_attributes_gives_the_rows_of_the_message():
    request = _request()
    from_bytes = convert.traces_payload(request.SerializeToString())
    assert _table(from_bytes) == _table(convert.traces(request))
    assert from_bytes.rows("otel_traces") == 16


def test_an_attribute_that_is_not_a_key_value_is_a_payload_error():
    raw = RawTraceRequest.FromString(_request(resources=1, scopes=1, spans=1).SerializeToString())
    raw.resource_spans[0].scope_spans[0].spans[0].attributes.append(b"\x0a\xff\xff")
    with pytest.raises(otlp.PayloadError, match="malformed"):
        convert.traces_payload(raw.SerializeToString())


def test_a_worker_process_converts_to_the_same_rows_and_refuses_the_same_payloads():
    request = _request()
    request.resource_spans[0].scope_spans[0].spans[1].trace_id = bytes(16)  # one rejected span
    payload = request.SerializeToString()
    pool = ConvertPool(1)
    pool.start()
    try:
        in_worker = pool.traces(payload)
        here = convert.traces_payload(payload)
        assert _table(in_worker) == _table(here)
        assert (in_worker.rejected, in_worker.error_message) == (1, here.error_message)
        with pytest.raises(otlp.PayloadError):
            pool.traces(b"\x0a\xff\xff\xff\xff\x0f garbage")
    finally:
        pool.close()


def _pending(spool: Spool, ages_s: list[float], spans: int) -> list:
    """Batches that arrived `ages_s` ago, sized like `spans` spans each (uncached batches are sized from
    their bytes, about 400 a span; what they hold does not matter here)."""
    now = time.time_ns()
    for i, age in enumerate(ages_s):
        spool.put("traces", f"{i:032x}", bytes(spans * 400), now - int(age * 1e9))
    return spool.pending()


@pytest.mark.parametrize(
    ("ages_s", "spans", "inflight", "lingers"),
    [
        ([0.5, 0.05], 512, 1, True),  # a stream still coming, the group small: wait for more
        ([0.5, QUIET_S + 0.3], 512, 1, False),  # the stream stopped: insert its tail now
        ([0.5, IDLE_QUIET_S + 0.05], 512, 0, False),  # and with nothing in flight, sooner
        ([LINGER_MAX_S + 0.5, 0.05], 512, 1, False),  # waited long enough
        ([0.5, 0.05], GROUP_MIN_ROWS // 2 + 1, 1, False),  # large enough already
    ],
)
def test_a_small_group_waits_only_while_batches_keep_coming(tmp_path, ages_s, spans, inflight, lingers):
    spool = Spool(tmp_path / "spool", 1 << 30).open()
    ingestor = Ingestor("chdb://memory", spool)
    ingestor._inflight = inflight  # requests being converted right now
    wait_s = ingestor._linger_s(_pending(spool, ages_s, spans))
    assert (wait_s > 0) is lingers and wait_s <= QUIET_S


def test_the_spool_keeps_its_own_list_and_a_reopen_reads_the_same_from_disk(tmp_path):
    spool = Spool(tmp_path / "spool", 10**7).open()
    now = time.time_ns()
    entries = [spool.put("traces", f"{i:032x}", bytes(100 + i), now + i) for i in range(5)]
    spool.remove(entries[1])
    spool.set_aside(entries[3])
    entries[4].path.unlink()  # removed by hand: forgotten when its removal comes, not counted twice
    spool.remove(entries[4])
    kept = [e.path.name for e in (entries[0], entries[2])]
    assert [e.path.name for e in spool.pending()] == kept
    assert (spool.count, spool.bytes_used) == (2, 100 + 102)
    reopened = Spool(tmp_path / "spool", 10**7).open()
    assert [e.path.name for e in reopened.pending()] == kept
    assert (reopened.count, reopened.bytes_used, reopened.failed_count()) == (2, 100 + 102, 1)
