"""OpenAI-compatible HTTP server (FastAPI): completions, chat, models, tokenize, health, version, metrics."""
