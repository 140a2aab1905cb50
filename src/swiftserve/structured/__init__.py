"""Structured output: grammars (JSON schema, regex, choice, Lark) compiled with llguidance,
and the token bitmasks that keep sampling inside them. A leaf package: it imports neither
torch nor the engine, so the server validates a schema before any engine work and the worker
masks logits with the same code.
"""
