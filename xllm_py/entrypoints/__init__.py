"""What users call: the OpenAI-compatible HTTP server (api_server.py: completions, chat,
Responses and Messages, tokenize, /health, /metrics) and its lifetime (serve.py), and the
offline `LLM` API (llm.py). Everything here speaks HTTP or is the offline API; the engine's
clients live in engine/, the model-output formats in formats/."""
