"""A small paged-KV serving engine in PyTorch, instrumented end to end through agent.telemetry."""
