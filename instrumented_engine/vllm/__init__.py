"""The vLLM observer's logic: what the plug-ins in `kvscope.vllm` record, and how the records of
every vLLM process become one run store (docs/DESIGN.md, "vLLM observer").

    kvscope.vllm.connector (a MultiConnector, in vLLM's engine-core process)
        scheduler side ── SchedulerObserver ──┐  per-process spool file
        worker side ──── WorkerObserver ──────┘  (records ride back in the worker metadata)
    kvscope.vllm.stat_logger (vLLM's frontend) ── StatsObserver ── its own spool file
    kvscope.vllm.sink.join_run(run_dir): every spool file ──► join.build (partition +
        accounting) ──► Recorder ──► the run store (its one writer)

Nothing here imports vLLM: the observer sees plain values (ids, counts, monotonic ns), so the
partition is tested without an engine and the plug-ins stay thin.
"""
