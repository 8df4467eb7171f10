"""flowkv: a KV-cache layer for LLM inference."""
