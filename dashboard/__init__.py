"""Streamlit + Plotly pages over the analyzers; alert rules and Grafana dashboards."""
