"""User-facing entry points: the offline `LLM` API (the REST server comes later)."""
