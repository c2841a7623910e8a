"""The diagnosis facade, called over the collector's API, its answer as the findings JSON dict.

The dashboard renders findings; it never derives a cause itself. When the diagnosis package cannot be
imported or fails, `DiagnosisUnavailable` says why and the page shows that instead.
"""

from __future__ import annotations

from typing import Any

import streamlit as st

from dashboard.data import Api
from dashboard.scope import Scope

DIAGNOSIS_TTL_S = 60  # a diagnosis reads many queries: reuse it across refreshes for a minute


class DiagnosisUnavailable(Exception):
    """The diagnosis could not run here (not installed, or it failed): the message says why."""


@st.cache_data(ttl=DIAGNOSIS_TTL_S, show_spinner="Diagnosing...")
def diagnose(
    api: Api, window: tuple[float, float], baseline: tuple[float, float] | None, scope: Scope
) -> dict[str, Any]:
    """`diagnosis.diagnose(open_reader(url=...), window, baseline)` as the findings JSON dict, reading only
    the rows of `scope`'s services and instances (as `stepscope diagnose --service/--instance` does);
    without a baseline the diagnosis splits the window at a change point it finds."""
    try:
        from collector.client import open_reader
        from collector.timerange import TimeRange
        from diagnosis import diagnose as run
        from diagnosis.fleet import scoped
    except ImportError as e:
        raise DiagnosisUnavailable(f"the diagnosis package is not installed here ({e})") from None
    try:
        source = scoped(
            open_reader(url=api.url, token=api.token), list(scope.services), list(scope.instances)
        )
    except Exception as e:  # the reader's own errors: shown, never raised into the page
        raise DiagnosisUnavailable(f"cannot open the collector as a diagnosis source: {e}") from None
    try:
        return run(source, TimeRange(*window), TimeRange(*baseline) if baseline else None).to_json()
    except Exception as e:  # a failing rule must not take the page down
        raise DiagnosisUnavailable(f"the diagnosis failed ({type(e).__name__}) {e}") from None
    finally:
        source.close()
