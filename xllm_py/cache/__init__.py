"""KV cache block management and prefix caching."""
