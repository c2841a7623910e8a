"""stepscope dashboard: Streamlit pages over the collector's query API (docs/dashboard.md)."""
