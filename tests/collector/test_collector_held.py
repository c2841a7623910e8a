"""Spans decoded once on arrival and held until their group is inserted: a group gets exactly its entries'
rows, a refused request's rows never appear, and past the bound spans are decoded again from the spool."""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from test_collector_durability import make_spans

from collector import convert, ingest, otlp, spans
from collector.held import HeldSpans
from collector.ingest import Ingestor
from collector.otlp import Decoded
from collector.spool import Spool
from collector.store import Store

pytestmark = pytest.mark.skipif(not spans.available(), reason="the compiled span decoder needs a C compiler")


def _payload(service: str, n: int) -> bytes:
    return encode_spans(make_spans(service, n)).SerializeToString()


def _services(table) -> dict[str, int]:
    counts: dict[str, int] = {}
    for service in table.column("ServiceName").to_pylist():
        counts[service] = counts.get(service, 0) + 1
    return counts


def test_a_group_takes_exactly_its_entries_rows_and_never_a_refused_requests(tmp_path):
    held = HeldSpans(max_rows=10_000)
    tickets = {name: held.feed(_payload(name, n))[0] for name, n in [("a", 3), ("b", 4), ("c", 5)]}
    held.attach("a", tickets["a"])
    held.attach("c", tickets["c"])
    held.drop(tickets["b"])  # its spooling failed: never acknowledged
    names, tables = held.take(["a"])
    assert names == {"a"} and [_services(t) for t in tables] == [{"a": 3}]
    held.release(["a"])

    held.attach("d", held.feed(_payload("d", 6))[0])  # fed after the first generation was taken
    names, tables = held.take(["c", "d", "not-held"])
    assert names == {"c", "d"} and [_services(t) for t in tables] == [{"c": 5}, {"d": 6}]
    table = convert.merge([convert.trace_batch(t, 0) for t in tables]).tables["otel_traces"]
    with Store.open(f"chdb://{tmp_path / 'db'}") as store:  # rows of two generations go in as one insert
        store.insert("otel_traces", table.column_names, table, token="held")
        rows = store.query("SELECT ServiceName, count() FROM otel_traces GROUP BY 1 ORDER BY 1").rows
    assert rows == [["c", 5], ["d", 6]]
    held.release(names)
    assert held.rows == 0


def test_past_the_bound_a_request_is_only_checked_and_bad_bytes_hold_nothing():
    held = HeldSpans(max_rows=5)
    ticket, batch = held.feed(_payload("a", 5))
    assert ticket is not None and batch.deferred_rows == 5
    ticket, batch = held.feed(_payload("b", 7))
    assert ticket is None and batch.deferred_rows == 7  # counted for the acknowledgement, not held
    with pytest.raises(otlp.PayloadError):
        held.feed(b"\x0a\xff\xff\xff\xff\x0f garbage")
    assert held.rows == 5


def test_held_and_respooled_spans_are_stored_once_each(tmp_path, monkeypatch):
    monkeypatch.setattr(ingest, "HELD_MAX_ROWS", 120)  # most requests past the bound: decoded at insert
    ingestor = Ingestor(f"chdb://{tmp_path / 'db'}", Spool(tmp_path / "spool", 1 << 26))
    ingestor.start()
    try:
        sent = {f"s{i}": 40 + i for i in range(12)}
        for service, n in sent.items():
            outcome = ingestor.submit("traces", Decoded(None, _payload(service, n)))
            assert outcome.rejected == 0
        assert ingestor.wait_drained(60)
        assert ingestor.store is not None
        rows = ingestor.store.query("SELECT ServiceName, count() FROM otel_traces GROUP BY 1").rows
        assert dict(map(tuple, rows)) == sent
    finally:
        ingestor.stop()
