"""Model code: Llama-family modules, paged attention, weight loading (torch lives here)."""
