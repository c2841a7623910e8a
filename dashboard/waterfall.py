"""One request's waterfall: its spans (client, server, queue, prefill chunks, KV transfer, decode) and
the engine steps it shared (through the step -> request links), as bars on lanes. Pure: frames in, a
frame out (lane, kind, start_ms, end_ms, detail), times relative to the trace's first span."""

from __future__ import annotations

import pandas as pd

from instrumentation import attributes as A

_LANES = {
    A.SPAN_CLIENT_REQUEST: ("client request", "client"),
    A.SPAN_REQUEST: ("request (server)", "request"),
    A.SPAN_QUEUE: ("queue", "queue"),
    A.SPAN_KV_TRANSFER: ("KV transfer", "KV transfer"),
    A.SPAN_DECODE: ("decode", "decode"),
}
STEPS_LANE = "engine steps"
COLUMNS = ["lane", "kind", "start_ms", "end_ms", "detail"]


def _ns(ts: pd.Series) -> pd.Series:
    """Epoch nanoseconds, whatever resolution pandas parsed the timestamps at."""
    return pd.to_datetime(ts, utc=True).dt.as_unit("ns").astype("int64")


def _span_row(name: str, attrs: dict[str, str], start_ms: float, end_ms: float) -> dict[str, object]:
    if name == A.SPAN_PREFILL:
        chunk = attrs.get(A.CHUNK_INDEX, "0")
        tokens = attrs.get(A.CHUNK_TOKENS, "?")
        lane, kind, detail = f"prefill chunk {chunk}", "prefill", f"{tokens} tokens"
        if attrs.get(A.PREFILL_RECOMPUTE) == "true":
            detail += " (recompute after preemption)"
    else:
        lane, kind = _LANES.get(name, (name, "other"))
        detail = name
        if name == A.SPAN_KV_TRANSFER and A.KV_TRANSFER_BYTES in attrs:
            detail = f"{attrs[A.KV_TRANSFER_BYTES]} bytes"
        if name == A.SPAN_DECODE and A.DECODE_TOKENS in attrs:
            detail = f"{attrs[A.DECODE_TOKENS]} tokens"
    return {
        "lane": lane,
        "kind": kind,
        "start_ms": start_ms,
        "end_ms": end_ms,
        "detail": f"{detail}, {end_ms - start_ms:,.2f} ms",
    }


def build(spans: pd.DataFrame, steps: pd.DataFrame | None = None) -> pd.DataFrame:
    """The waterfall rows of a trace (`spans` from /api/traces/{id}; `steps` from queries.LINKED_STEPS)."""
    if spans.empty:
        return pd.DataFrame(columns=COLUMNS)
    start_ns = _ns(spans["Timestamp"])
    t0 = int(start_ns.min())
    rows = []
    for (_, span), s_ns in zip(spans.iterrows(), start_ns, strict=True):
        if span["SpanName"] in (A.SPAN_STEP_SCHEDULE, A.SPAN_STEP_FORWARD, A.SPAN_STEP_SAMPLE):
            continue
        start_ms = (int(s_ns) - t0) / 1e6
        end_ms = start_ms + float(span["Duration"]) / 1e6
        rows.append(_span_row(span["SpanName"], span["SpanAttributes"] or {}, start_ms, end_ms))
    if steps is not None and not steps.empty:
        for (_, step), s_ns in zip(steps.iterrows(), _ns(steps["time"]), strict=True):
            start_ms = (int(s_ns) - t0) / 1e6
            end_ms = start_ms + float(step["duration_s"]) * 1000
            kind = "step (prefill)" if bool(step["is_prefill"]) else "step (decode)"
            detail = (
                f"step {step['step_id']}: batch {step['batch_size']}, {step['prefill_tokens']} prefill + "
                f"{step['decode_tokens']} decode tokens, {step['tokens_for_request']} for this request"
            )
            rows.append(
                {"lane": STEPS_LANE, "kind": kind, "start_ms": start_ms, "end_ms": end_ms, "detail": detail}
            )
    df = pd.DataFrame(rows, columns=COLUMNS)
    df["rank"] = [_rank(lane) for lane in df["lane"]]
    return df.sort_values(["rank", "start_ms"]).drop(columns="rank").reset_index(drop=True)


_FIXED = {
    "client request": 0,
    "request (server)": 1,
    "queue": 2,
    "KV transfer": 4,
    "decode": 5,
    STEPS_LANE: 7,
}


def _rank(lane: str) -> tuple[int, int, str]:
    """Lanes top to bottom in the order a request lives through them; prefill chunks by index."""
    if lane.startswith("prefill chunk"):
        tail = lane.rsplit(" ", 1)[1]
        return (3, int(tail) if tail.isdigit() else 0, lane)
    return (_FIXED.get(lane, 6), 0, lane)
