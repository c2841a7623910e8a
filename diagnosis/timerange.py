"""Time windows: `TimeRange` (unix seconds, half-open) and the parser for the CLI's time arguments."""

from __future__ import annotations

import datetime as dt
import re
import time
from dataclasses import dataclass

_AGO_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


@dataclass(frozen=True, slots=True)
class TimeRange:
    """[start, end) in unix seconds."""

    start: float
    end: float

    def __post_init__(self) -> None:
        if not self.end > self.start:
            raise ValueError(f"a time range needs end > start, got {self.start} .. {self.end}")

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def start_ns(self) -> int:
        return round(self.start * 1e9)

    @property
    def end_ns(self) -> int:
        return round(self.end * 1e9)

    def to_json(self) -> dict[str, object]:
        """`{"from": unix s, "to": unix s, "from_iso": ..., "to_iso": ..., "seconds": ...}`."""
        return {
            "from": round(self.start, 3),
            "to": round(self.end, 3),
            "from_iso": iso(self.start),
            "to_iso": iso(self.end),
            "seconds": round(self.seconds, 3),
        }


def iso(t: float) -> str:
    """Unix seconds as ISO 8601 UTC with milliseconds."""
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_time(text: str, now: float | None = None) -> float:
    """Unix seconds from ISO 8601 (`2025-01-02T03:04:05Z`; no zone means UTC), unix seconds (`1700000000.5`),
    or an ago-duration (`90s`, `15m`, `2h`, `1d`, `500ms`: that long before `now`). ValueError otherwise."""
    s = (text or "").strip()
    now = time.time() if now is None else now
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h|d)", s)
    if m:
        return now - float(m.group(1)) * _AGO_UNITS[m.group(2)]
    if re.fullmatch(r"\d+(?:\.\d*)?", s):
        return float(s)
    try:
        parsed = dt.datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"cannot read time {text!r}: use ISO 8601, unix seconds, or an ago-duration like 15m"
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.UTC)
    return parsed.timestamp()
