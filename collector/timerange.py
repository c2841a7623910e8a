"""Time windows over the stored data: `TimeRange` (unix seconds, half-open), shared by the diagnosis, the
alerts and the dashboard, and the parser for the command line's time arguments."""

from __future__ import annotations

import datetime as dt
import re
import time
from dataclasses import dataclass

_AGO_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_NICE_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)
_POINTS = 30  # buckets per chart: enough for a shape, enough requests in each for a P99


@dataclass(frozen=True, slots=True)
class DataSpan:
    """What the store holds: request count and the first and last request start (unix seconds)."""

    requests: int
    first: float | None
    last: float | None

    @property
    def empty(self) -> bool:
        return self.requests == 0 or self.first is None or self.last is None


@dataclass(frozen=True, slots=True)
class TimeRange:
    """[start, end) in unix seconds. A range the dashboard picked also says how it was chosen (`label`),
    why when not as asked (`note`), and how much of it the stored data covers (`data_s`, sizes buckets)."""

    start: float
    end: float
    label: str = ""
    note: str | None = None
    data_s: float | None = None

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

    @property
    def interval_s(self) -> int:
        """A round bucket width giving about 30 points over the data in the range."""
        want = (self.data_s or self.seconds) / _POINTS
        return next((n for n in _NICE_S if n >= want), _NICE_S[-1])

    def covering(self, span: DataSpan) -> TimeRange:
        """This range, with buckets sized to the part of it the stored data covers."""
        if span.empty:
            return self
        assert span.first is not None and span.last is not None
        covered = min(self.end, span.last + 1) - max(self.start, span.first)
        return TimeRange(self.start, self.end, self.label, self.note, covered if covered > 0 else None)

    def before(self) -> TimeRange:
        """The range of equal length just before this one (the default diagnosis baseline)."""
        return TimeRange(
            self.start - self.seconds, self.start, f"the {self.label} before", data_s=self.data_s
        )

    def halves(self) -> tuple[TimeRange, TimeRange]:
        """(first half, second half): a baseline and a window inside one range."""
        mid = (self.start + self.end) / 2
        half = None if self.data_s is None else self.data_s / 2
        return (
            TimeRange(self.start, mid, "first half of the range", data_s=half),
            TimeRange(mid, self.end, "second half of the range", data_s=half),
        )

    def params(self, **extra: object) -> dict[str, object]:
        """SQL parameters `since`, `until` (unix seconds), `interval_s` (and `extra`)."""
        return {"since": self.start, "until": self.end, "interval_s": self.interval_s, **extra}

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
