"""HTTP: OpenAI-compatible schemas and the FastAPI routes over an engine."""
