"""Prompt text to token ids, the way vLLM's OpenAI server does it, for lookups by text and routing.

A completion's prompt is encoded with the tokenizer's special tokens (vLLM's
default for ``/v1/completions``); chat messages go through the tokenizer's
chat template with the generation prompt added. Tokenizers are loaded once per
name or path, from local files only (no model hub at run time).
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["Tokenizers"]


class Tokenizers:
    """A cache of tokenizers by name or path."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded: dict[str, Any] = {}

    def get(self, name: str) -> Any:
        with self._lock:
            tokenizer = self._loaded.get(name)
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
                self._loaded[name] = tokenizer
            return tokenizer

    def encode(self, name: str, *, prompt: str | list[int] | None = None,
               messages: list[dict[str, Any]] | None = None) -> list[int]:
        """The token ids vLLM prefills for ``prompt`` (a completion) or ``messages`` (a chat)."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        tokenizer = self.get(name)
        if messages is not None:
            ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            if isinstance(ids, dict):  # newer transformers answer a BatchEncoding
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        if not isinstance(prompt, str):
            raise ValueError("a prompt must be a string or a list of token ids")
        return [int(t) for t in tokenizer(prompt, add_special_tokens=True)["input_ids"]]
