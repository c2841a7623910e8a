"""The time range every page shows: presets and the automatic fallback to the stored data (the range
itself, with its bucket widths, is `collector.timerange.TimeRange`).

Pure: the sidebar (dashboard/ui.py) reads the widgets and calls `resolve`; tests call it directly.
"""

from __future__ import annotations

from collector.timerange import DataSpan, TimeRange

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
    if span.empty or (span.last is not None and span.last >= recent.start):
        return recent.covering(span)
    return stored(
        span,
        "stored data",
        "No requests in the last 15 minutes: showing the span of the stored data instead.",
    )
