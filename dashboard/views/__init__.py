"""The dashboard's pages: each file is run by Streamlit as a script (see dashboard/app.py)."""
