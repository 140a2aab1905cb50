"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over AsyncLLM."""
