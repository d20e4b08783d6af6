"""A small paged-KV serving engine in PyTorch, instrumented end to end through agent.telemetry.

    workloads ─► runner (real-time arrivals) ─► engine ─┬─► scheduler ─► core (block pool,
                                                        │                chained hashes, tables)
                                                        ├─► model_runner ─► model (Llama, paged
                                                        │                   attention, loader)
                                                        └─► telemetry ─► agent.telemetry.Recorder
    session: one `kvscope run` (engine + workload + exporters + summary)

Import the parts you need from their modules (`instrumented_engine.engine.LLMEngine`, ...);
this package imports nothing at import time.
"""
