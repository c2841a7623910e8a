"""The time range every page shows: presets, the automatic fallback to the stored data, bucket widths.

Pure: the sidebar (dashboard/ui.py) reads the widgets and calls `resolve`; tests call it directly.
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO = "Auto: last 15 min, else the stored data"
ALL = "All stored data"
CUSTOM = "Custom"
PRESETS: dict[str, int | None] = {
    AUTO: None,
    "Last 5 min": 300,
    "Last 15 min": 900,
    "Last 1 h": 3600,
    "Last 6 h": 6 * 3600,
    "Last 24 h": 24 * 3600,
    ALL: None,
    CUSTOM: None,
}
AUTO_WINDOW_S = 900  # the diagnosis default: the last 15 minutes against the 15 before
_NICE_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)
_POINTS = 30  # buckets per chart: enough for a shape, enough requests in each for a P99


@dataclass(frozen=True, slots=True)
class DataSpan:
    """What the store holds: request count and the first and last request start (epoch seconds)."""

    requests: int
    first: float | None
    last: float | None

    @property
    def empty(self) -> bool:
        return self.requests == 0 or self.first is None or self.last is None


@dataclass(frozen=True, slots=True)
class TimeRange:
    """[since, until) in epoch seconds, how it was chosen (`label`), and why, when not as asked (`note`)."""

    since: float
    until: float
    label: str
    note: str | None = None
    data_s: float | None = None  # how much of the range the stored data covers (sizes the buckets)

    def __post_init__(self) -> None:
        if not self.until > self.since:
            raise ValueError(f"empty time range: {self.since} .. {self.until}")

    @property
    def duration_s(self) -> float:
        return self.until - self.since

    @property
    def interval_s(self) -> int:
        """A round bucket width giving about 30 points over the data in the range."""
        want = (self.data_s or self.duration_s) / _POINTS
        return next((n for n in _NICE_S if n >= want), _NICE_S[-1])

    def covering(self, span: DataSpan) -> TimeRange:
        """This range, with buckets sized to the part of it the stored data covers."""
        if span.empty:
            return self
        assert span.first is not None and span.last is not None
        covered = min(self.until, span.last + 1) - max(self.since, span.first)
        return TimeRange(self.since, self.until, self.label, self.note, covered if covered > 0 else None)

    def before(self) -> TimeRange:
        """The range of equal length just before this one (the default diagnosis baseline)."""
        return TimeRange(
            self.since - self.duration_s, self.since, f"the {self.label} before", data_s=self.data_s
        )

    def halves(self) -> tuple[TimeRange, TimeRange]:
        """(first half, second half): a baseline and a window inside one range."""
        mid = (self.since + self.until) / 2
        return (
            TimeRange(self.since, mid, "first half of the range", data_s=_half(self.data_s)),
            TimeRange(mid, self.until, "second half of the range", data_s=_half(self.data_s)),
        )

    def params(self, **extra: object) -> dict[str, object]:
        """SQL parameters `since`, `until`, `interval_s` (and `extra`)."""
        return {"since": self.since, "until": self.until, "interval_s": self.interval_s, **extra}


def _half(seconds: float | None) -> float | None:
    return None if seconds is None else seconds / 2


def stored(span: DataSpan, label: str = "all stored data", note: str | None = None) -> TimeRange:
    """The span of the stored requests, padded to whole seconds so that the last request is inside."""
    assert span.first is not None and span.last is not None
    return TimeRange(float(int(span.first)), float(int(span.last) + 1), label, note)


def resolve(choice: str, now: float, span: DataSpan, custom: tuple[float, float] | None = None) -> TimeRange:
    """The range for a picker choice at `now`. Auto is the last 15 minutes when they hold requests, else
    the span of the stored data (with a note saying so); an empty store gives the last 15 minutes."""
    if choice == CUSTOM and custom is not None and custom[1] > custom[0]:
        return TimeRange(custom[0], custom[1], "custom range").covering(span)
    if choice == ALL and not span.empty:
        return stored(span)
    seconds = PRESETS.get(choice)
    if seconds is not None:
        return TimeRange(now - seconds, now, choice.lower()).covering(span)
    recent = TimeRange(now - AUTO_WINDOW_S, now, "last 15 min")
    if span.empty or (span.last is not None and span.last >= recent.since):
        return recent.covering(span)
    return stored(
        span,
        "stored data",
        "No requests in the last 15 minutes: showing the span of the stored data instead.",
    )
