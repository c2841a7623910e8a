"""Nothing acknowledged is lost: kill -9 after the acks, an unreachable store, a replay after a crash."""

from __future__ import annotations

import signal

import httpx
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from collector import convert, otlp
from collector.ingest import Ingestor, batch_token
from collector.spool import Spool
from collector.store import Store
from instrumentation import attributes as A
from tests.support.net import free_port


def make_spans(service: str, n: int, step_every: int = 0) -> list:
    """`n` spans; with `step_every`, every such span is an engine step (which the `steps` view keeps)."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("tests.durability")
    for i in range(n):
        if step_every and i % step_every == 0:
            attrs = {A.STEP_ID: i, A.STEP_BATCH_SIZE: 1 + i % 8}
            with tracer.start_as_current_span(A.SPAN_STEP, attributes=attrs):
                pass
        else:
            with tracer.start_as_current_span("work", attributes={"i": i}):
                pass
    return list(memory.get_finished_spans())


def export(url: str, spans: list, batch: int) -> int:
    """Send with the SDK's OTLP/HTTP exporter; return how many spans were acknowledged."""
    exporter = OTLPSpanExporter(endpoint=f"{url}/v1/traces", timeout=30)
    acked = 0
    for k in range(0, len(spans), batch):
        if exporter.export(spans[k : k + batch]) == SpanExportResult.SUCCESS:
            acked += len(spans[k : k + batch])
    return acked


def test_kill_9_right_after_the_acks_loses_no_acknowledged_span(start_collector, tmp_path):
    c = start_collector()
    acked = export(c.url, make_spans("killed", 4000, step_every=4), batch=500)
    assert acked == 4000
    c.stop(signal.SIGKILL)
    c = start_collector()
    # otel_traces can hold every span before the replay has filled the views: wait for the spool
    assert c.wait_drained()
    assert c.scalar("SELECT count() FROM otel_traces WHERE ServiceName = 'killed'") == acked
    assert c.scalar("SELECT uniqExact(SpanId) FROM otel_traces") == acked
    # the views saw each span once, too: one `steps` row per step span, none for the others
    assert c.scalar("SELECT count() FROM steps") == 1000
    assert c.scalar("SELECT uniqExact(step_id) FROM steps WHERE service = 'killed'") == 1000
    assert c.scalar("SELECT count() FROM otel_traces_trace_id_ts") == acked  # one trace per span


def test_unreachable_server_spools_and_a_restart_on_a_reachable_store_drains_it_once(
    start_collector, tmp_path
):
    spool = str(tmp_path / "spool")
    dead = f"http://default:secret@127.0.0.1:{free_port()}/stepscope"
    c = start_collector("--spool", spool, store=dead)
    health = c.health()
    assert health["store"] == "down" and "unreachable" in health["store_error"]
    assert "secret" not in c.log.read_text()
    acked = export(c.url, make_spans("spooled", 1500), batch=300)
    assert acked == 1500
    assert c.health()["spooled_batches"] == 5
    assert httpx.post(f"{c.url}/api/sql", json={"sql": "SELECT 1"}).status_code == 503
    c.stop()

    c = start_collector("--spool", spool, store=f"chdb://{tmp_path / 'reachable'}")
    assert c.wait_drained()
    assert c.scalar("SELECT count() FROM otel_traces") == acked
    assert c.scalar("SELECT uniqExact(SpanId) FROM otel_traces") == acked
    c.stop()
    c = start_collector("--spool", spool, store=f"chdb://{tmp_path / 'reachable'}")
    assert c.scalar("SELECT count() FROM otel_traces") == acked  # a second start replays nothing


def test_a_full_spool_answers_503_with_retry_after(start_collector, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}/db"
    c = start_collector("--spool", str(tmp_path / "spool"), "--spool-max-bytes", "20000", store=dead)
    body = encode_spans(make_spans("full", 40)).SerializeToString()
    statuses = [
        httpx.post(f"{c.url}/v1/traces", content=body, headers={"Content-Type": "application/x-protobuf"})
        for _ in range(8)
    ]
    assert statuses[0].status_code == 200
    refused = [r for r in statuses if r.status_code == 503]
    assert refused and int(refused[0].headers["Retry-After"]) > 0


def test_a_group_inserted_before_a_crash_is_replayed_without_duplicates(tmp_path):
    dsn = f"chdb://{tmp_path / 'db'}"
    payload = encode_spans(make_spans("replayed", 50)).SerializeToString()
    spool = Spool(tmp_path / "spool", 1 << 20).open()
    entry = spool.put("traces", batch_token("traces", payload), payload, 1)
    group_token = batch_token("group", entry.token.encode())
    spool.write_group(group_token, [entry])
    batch = convert.traces(otlp.parse_canonical("traces", payload))
    with Store.open(dsn) as store:  # the insert went in; the crash came before the spool was cleaned up
        store.insert(
            "otel_traces", batch.columns["otel_traces"], batch.tables["otel_traces"], token=group_token
        )

    ingestor = Ingestor(dsn, Spool(tmp_path / "spool", 1 << 20))
    ingestor.start()
    try:
        assert ingestor.wait_drained(30)
        assert ingestor.store is not None
        assert ingestor.store.query("SELECT count() FROM otel_traces").rows == [[50]]
        assert not list((tmp_path / "spool" / "groups").glob("*.json"))
    finally:
        ingestor.stop()


def test_a_group_cut_short_between_the_table_and_a_view_is_completed_by_its_replay(tmp_path):
    # One insert commits otel_traces' part before the views' parts: a crash in between leaves the spans
    # in otel_traces and not in `steps`. Detaching the view for the first insert leaves that same state.
    dsn = f"chdb://{tmp_path / 'db'}"
    payload = encode_spans(make_spans("cut", 400, step_every=4)).SerializeToString()
    spool = Spool(tmp_path / "spool", 1 << 20).open()
    entry = spool.put("traces", batch_token("traces", payload), payload, 1)
    group_token = batch_token("group", entry.token.encode())
    spool.write_group(group_token, [entry])
    batch = convert.traces(otlp.parse_canonical("traces", payload))
    with Store.open(dsn) as store:
        store.command("DETACH TABLE steps_mv")
        store.insert(
            "otel_traces", batch.columns["otel_traces"], batch.tables["otel_traces"], token=group_token
        )
        store.command("ATTACH TABLE steps_mv")
        assert store.query("SELECT count() FROM steps").rows == [[0]]

    ingestor = Ingestor(dsn, Spool(tmp_path / "spool", 1 << 20))
    ingestor.start()
    try:
        assert ingestor.wait_drained(30)
        assert ingestor.store is not None
        counts = "SELECT (SELECT count() FROM otel_traces), (SELECT count() FROM otel_traces_trace_id_ts), "
        counts += "(SELECT count() FROM steps), (SELECT uniqExact(step_id) FROM steps)"
        # the table and the view that had the group drop the replay; the view that missed it gets it, once
        assert ingestor.store.query(counts).rows == [[400, 400, 100, 100]]
    finally:
        ingestor.stop()
