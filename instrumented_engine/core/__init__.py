"""KV-cache core: block identity (chained digests), the block pool, per-request block tables."""
