"""Helpers for testing flowkv and the stages and tiers users write.

- ``make_paged_kv`` / ``random_slot_mapping``: a synthetic paged KV cache in
  any supported layout, and slot mappings shaped the way vLLM makes them.
- ``tiny_model(path)``: a random-weight Llama and a locally trained tokenizer
  that vLLM loads, for end-to-end tests without a model hub.
- ``ManualClock``: a clock that moves when the test says so; pass it as
  ``CacheEngine(..., clock=...)`` and pin deadlines and the pin timer follow it.
"""

from __future__ import annotations

from typing import Any

from flowkv._testing.paged import make_paged_kv, random_slot_mapping
from flowkv.clock import ManualClock


def tiny_model(path: Any, **kwargs: Any) -> Any:
    """Build (once) a tiny random-weight Llama with a local tokenizer at ``path``; see
    ``flowkv._testing.tiny_model.tiny_model`` for the options."""
    from flowkv._testing.tiny_model import tiny_model as build

    return build(path, **kwargs)


__all__ = ["ManualClock", "make_paged_kv", "random_slot_mapping", "tiny_model"]
