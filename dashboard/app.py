"""The Streamlit app: `streamlit run dashboard/app.py` (what `stepscope dashboard` starts).

Reads its config from the environment (dashboard/config.py), asks the collector's API what the store
holds, draws the sidebar, then runs the chosen page from dashboard/views/.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from dashboard import data, ui
from dashboard.config import DashboardConfig

VIEWS = Path(__file__).resolve().parent / "views"
# (file, title, icon, url path): the sidebar nav lists them in this order
PAGES = (
    ("overview.py", "Overview", ":material/monitoring:", "overview"),
    ("findings.py", "Findings", ":material/troubleshoot:", "findings"),
    ("request_traces.py", "Requests", ":material/timeline:", "requests"),
    ("engine_steps.py", "Engine", ":material/memory:", "engine"),
    ("instances.py", "Instances", ":material/dns:", "instances"),
    ("capacity.py", "Capacity", ":material/speed:", "capacity"),
    ("gpu.py", "GPU", ":material/developer_board:", "gpu"),
)
NEEDS_NO_STORE = {"capacity"}  # bench files can be read with an empty store


def main() -> None:
    """One run of the app: config, navigation, store check, sidebar, page."""
    st.set_page_config(page_title="stepscope", page_icon=":material/monitoring:", layout="wide")
    pages = [
        st.Page(VIEWS / file, title=title, icon=icon, url_path=path, default=i == 0)
        for i, (file, title, icon, path) in enumerate(PAGES)
    ]
    page = st.navigation(pages)
    try:
        cfg = DashboardConfig.from_env()
    except (TypeError, ValueError) as e:
        st.warning(f"The dashboard's settings are not usable: {e}")
        st.stop()
    api = data.Api(cfg.api, cfg.token, cfg.http_timeout_s)
    span = ui.data_span(api)
    if span is None:  # unreachable or refused: the warning is on the page already
        st.title(page.title)
        st.stop()
    ui.set_context(ui.sidebar(cfg, api, span))
    if span.empty and page.url_path not in NEEDS_NO_STORE:
        st.title(page.title)
        st.info(
            f"The store behind {cfg.api} holds no requests yet. Point an engine at the collector "
            f"(`stepscope serve --otlp-endpoint {cfg.api}`) and send it traffic (`stepscope bench`)."
        )
        st.stop()
    page.run()


main()
