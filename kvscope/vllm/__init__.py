"""The plug-ins vLLM loads (composition roots): `connector.KvscopeObserverConnector` (a
MultiConnector that wraps the user's KV connector(s) and records lookups, loads, layer waits,
saves and steps) and `stat_logger.KvscopeStatLogger` (vLLM's own per-request durations, for the
side-by-side in `kvscope analyze`). Both are inert unless a run directory is configured
(`kvscope_run_dir` in the connector's extra config, or $KVSCOPE_VLLM_RUN_DIR). `python -m
kvscope.vllm join RUN` turns the spooled records into the run store (`kvscope run --engine vllm`
does it by itself). Nothing here is imported unless vLLM loads it.
"""

#: The environment variable that names the run directory (the stat logger's only setting).
RUN_DIR_ENV = "KVSCOPE_VLLM_RUN_DIR"
