"""SGLang's request traces into `requests`, as vLLM's `llm_request` spans go there.

SGLang (`--enable-trace`, python/sglang/srt/tracing) does not put a request's latencies on one span. It
emits, per request and process:

    Bootstrap Room 0x...                 (the trace's root; PD disaggregation puts both halves under it)
    └── "[prefill |decode ]Req <rid[:8]>"   attribute rid: the request root, start to finish
        ├── <thread span> (tokenizer)     └── tokenize, dispatch
        └── <thread span> (scheduler)     └── request_process, prefill_waiting, prefill_forward
                                              (chunked_prefill inside), decode_loop; with PD:
                                              prefill_bootstrap, prefill_transfer_kv_cache,
                                              decode_bootstrap, decode_waiting, decode_transferred

The stage slices come from the scheduler process, the root from the tokenizer: different exporters, so
different batches, and no materialized view can join them as they arrive. The assembler runs in the
collector: every ASSEMBLE_EVERY_S it inserts, with one INSERT ... SELECT, a `requests` row for every SGLang
request root that ended at least `grace_s` ago and has none yet, its phases summed from the slices under
its thread spans. It passes only while spans named like request roots arrive (and for `grace_s` and two
passes after the last ones), so a collector that receives none, vLLM's or stepscope's spans alone
included, runs no query:

    queue_s = prefill_waiting (+ decode_waiting on a decode worker), prefill_s = prefill_forward,
    decode_s = decode_loop, kv_transfer_s = the bootstrap and transfer slices,
    ttft_s = the end of the last prefill_forward - the root's start, e2e_s = the root's duration.

Token counts are not on SGLang's spans: they stay 0, and tpot_s is NULL (the scraped
`sglang:inter_token_latency_seconds` histogram carries it: docs/collector.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pyarrow as pa
import pyarrow.compute as pc

from collector.store import Store

log = logging.getLogger(__name__)

ASSEMBLE_EVERY_S = 2.0
FIRST_LOOKBACK_S = 86_400.0  # after a start, roots this old are still assembled
LOOKBACK_S = 300.0  # later passes look back this far (a pass that failed is covered by the next)
ROOT_NAME = r"^((prefill|decode|null) )?\s*Req \S+$"
_ROOT_SQL = ROOT_NAME.replace("\\", "\\\\")  # inside a SQL string literal

ASSEMBLE = f"""
INSERT INTO requests (time, end_time, trace_id, span_id, service, instance, role, model, request_id,
                      ttft_s, tpot_s, tpot_max_s, e2e_s, queue_s, prefill_s, kv_transfer_s, decode_s,
                      input_tokens, output_tokens, cached_tokens, max_tokens, prefix_key, finish_reason,
                      preemptions, itl_count, is_error, status_message)
WITH candidates AS (
    -- hasToken and mapContains let the name and attribute-key skip indexes pass over granules of other spans
    SELECT Timestamp, Duration, TraceId, SpanId, SpanName, ServiceName, ResourceAttributes, SpanAttributes,
           StatusCode, StatusMessage
    FROM otel_traces
    WHERE hasToken(lower(SpanName), 'req') AND mapContains(SpanAttributes, 'rid')
      AND match(SpanName, '{_ROOT_SQL}')
      AND Timestamp >= fromUnixTimestamp64Nano({{since:Int64}})
      AND addNanoseconds(Timestamp, Duration) < fromUnixTimestamp64Nano({{until:Int64}})
),
roots AS (
    SELECT * FROM candidates
    WHERE SpanId NOT IN (
        SELECT span_id FROM requests
        WHERE time >= fromUnixTimestamp64Nano({{since:Int64}})
          AND trace_id IN (SELECT TraceId FROM candidates))
),
stages AS (
    SELECT thread.ParentSpanId AS root_id, slice.SpanName AS name,
           toUnixTimestamp64Nano(slice.Timestamp) + slice.Duration AS end_ns, slice.Duration AS duration_ns
    FROM otel_traces AS slice
    INNER JOIN otel_traces AS thread ON slice.ParentSpanId = thread.SpanId AND slice.TraceId = thread.TraceId
    WHERE slice.TraceId IN (SELECT TraceId FROM roots) AND thread.TraceId IN (SELECT TraceId FROM roots)
),
phases AS (
    SELECT root_id,
           sumIf(duration_ns, name IN ('prefill_waiting', 'decode_waiting')) / 1e9 AS queue_s,
           countIf(name IN ('prefill_waiting', 'decode_waiting')) AS queue_n,
           sumIf(duration_ns, name = 'prefill_forward') / 1e9 AS prefill_s,
           countIf(name = 'prefill_forward') AS prefill_n,
           maxIf(end_ns, name = 'prefill_forward') AS first_token_ns,
           sumIf(duration_ns, name = 'decode_loop') / 1e9 AS decode_s,
           countIf(name = 'decode_loop') AS decode_n,
           sumIf(duration_ns, name IN ('prefill_bootstrap', 'prefill_transfer_kv_cache', 'decode_bootstrap',
                                       'decode_transferred')) / 1e9 AS kv_transfer_s
    FROM stages
    GROUP BY root_id
)
SELECT r.Timestamp, addNanoseconds(r.Timestamp, r.Duration), r.TraceId, r.SpanId, r.ServiceName,
       r.ResourceAttributes['service.instance.id'],
       multiIf(startsWith(r.SpanName, 'prefill '), 'prefill', startsWith(r.SpanName, 'decode '), 'decode',
               'colocated'),
       r.ResourceAttributes['stepscope.model'],
       r.SpanAttributes['rid'],
       if(p.prefill_n > 0, (p.first_token_ns - toUnixTimestamp64Nano(r.Timestamp)) / 1e9, NULL),
       NULL, NULL,
       r.Duration / 1e9,
       if(p.queue_n > 0, p.queue_s, NULL),
       if(p.prefill_n > 0, p.prefill_s, NULL),
       p.kv_transfer_s,
       if(p.decode_n > 0, p.decode_s, NULL),
       0, 0, 0, 0, '', '', 0, 0,
       r.StatusCode = 'STATUS_CODE_ERROR', r.StatusMessage
FROM roots AS r
LEFT JOIN phases AS p ON p.root_id = r.SpanId
SETTINGS join_use_nulls = 0
"""


def has_roots(spans: pa.Table) -> bool:
    """Whether an inserted otel_traces table holds spans named like SGLang's request roots (a substring
    test over the names, a millisecond for 50,000 spans): other groups give the assembler nothing to do."""
    return bool(pc.any(pc.match_substring(spans.column("SpanName"), "Req ")).as_py())


class SglangAssembler:
    """The background task: `start(ingestor, config)` (collector.server.BackgroundTask) starts it."""

    def __init__(self, store_of: object, grace_s: float, progress: Callable[[], int] = lambda: 0) -> None:
        self._store_of = store_of  # () -> Store | None: the collector's store once open
        self._progress = progress  # () -> a number that changes when spans were inserted
        self.grace_s = grace_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sglang-assemble", daemon=True)
        self.assembled = 0

    @classmethod
    def start(cls, ingestor: object, config: object) -> SglangAssembler:
        task = cls(
            lambda: ingestor.store,  # type: ignore[attr-defined]
            float(config.assemble_grace_s),  # type: ignore[attr-defined]
            lambda: ingestor.sglang_groups,  # type: ignore[attr-defined]
        )
        task._thread.start()
        return task

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        lookback = FIRST_LOOKBACK_S  # until a first pass went through: roots stored before a restart
        seen = self._progress()
        until = 0.0  # pass until then: the last spans' roots are past their grace
        while not self._stop.wait(ASSEMBLE_EVERY_S):
            mark, now = self._progress(), time.monotonic()
            if mark != seen:
                seen, until = mark, now + self.grace_s + 2 * ASSEMBLE_EVERY_S
            first = lookback == FIRST_LOOKBACK_S  # the first pass runs whether spans arrive or not
            store = self._store_of()  # type: ignore[operator]
            if store is None or (now > until and not first):
                continue
            try:
                self.assemble_once(store, lookback)
                lookback = LOOKBACK_S
            except Exception as e:  # the store is down or refused: the next pass covers this one's roots
                log.warning("assembling SGLang requests failed: %s", e)
                until = max(until, now + 2 * ASSEMBLE_EVERY_S)

    def assemble_once(self, store: Store, lookback_s: float) -> None:
        """Insert the rows of SGLang roots that ended in [now - lookback_s, now - grace_s) and have none."""
        now = time.time()
        store.command(
            ASSEMBLE,
            {"since": int((now - lookback_s) * 1e9), "until": int((now - self.grace_s) * 1e9)},
        )
