"""vLLM KV events in and out: the coordinator's subscriber and re-publisher (docs/routing.md)."""
