"""The diagnosis facade, called over the collector's API, its answer as the findings JSON dict.

The dashboard renders findings; it never derives a cause itself. When the diagnosis package cannot be
imported or fails, `DiagnosisUnavailable` says why and the page shows that instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import streamlit as st

from dashboard.data import Api

DIAGNOSIS_TTL_S = 60  # a diagnosis reads many queries: reuse it across refreshes for a minute


class DiagnosisUnavailable(Exception):
    """The diagnosis could not run here (not installed yet, or it failed): the message says why."""


def _as_json(result: Any) -> dict[str, Any]:
    if isinstance(result, dict):
        return result
    for name in ("to_json", "to_dict", "as_dict"):
        if callable(getattr(result, name, None)):
            return getattr(result, name)()
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        return dataclasses.asdict(result)
    raise DiagnosisUnavailable(f"the diagnosis returned {type(result).__name__}, not findings JSON")


@st.cache_data(ttl=DIAGNOSIS_TTL_S, show_spinner="Diagnosing...")
def diagnose(api: Api, window: tuple[float, float], baseline: tuple[float, float] | None) -> dict[str, Any]:
    """`diagnosis.diagnose(open_source(api=...), window, baseline)` as the findings JSON dict; without a
    baseline the diagnosis splits the window at a change point it finds."""
    try:
        import diagnosis
        from diagnosis.timerange import TimeRange
    except ImportError as e:
        raise DiagnosisUnavailable(f"the diagnosis package is not installed here ({e})") from None
    open_source = getattr(diagnosis, "open_source", None)
    run = getattr(diagnosis, "diagnose", None)
    if open_source is None or run is None:
        raise DiagnosisUnavailable("this build's diagnosis package has no `open_source`/`diagnose` yet")
    try:
        source = open_source(api=api.url, token=api.token)
    except Exception as e:  # the facade's own errors: shown, never raised into the page
        raise DiagnosisUnavailable(f"cannot open the collector as a diagnosis source: {e}") from None
    try:
        return _as_json(run(source, TimeRange(*window), TimeRange(*baseline) if baseline else None))
    except DiagnosisUnavailable:
        raise
    except Exception as e:  # a failing rule must not take the page down
        raise DiagnosisUnavailable(f"the diagnosis failed ({type(e).__name__}) {e}") from None
    finally:
        close = getattr(source, "close", None)
        if callable(close):
            close()
