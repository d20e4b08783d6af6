"""CLI subcommands, one light module each.

Each module imports only typer at import time and its heavy dependencies (torch, pandas,
streamlit) inside the command body, so `kvscope agent` never loads torch or pandas.
"""
