"""The engine: EngineCore (schedule + execute), output processing, and the offline LLM API."""
