"""Helpers for testing flowkv and the stages and tiers users write.

- ``run_stage(func, items, **settings)``: run one ``@flowkv.stage`` function
  through the real runner (spans and all) and collect what it yields.
- ``make_paged_kv`` / ``random_slot_mapping``: a synthetic paged KV cache in
  any supported layout, and slot mappings shaped the way vLLM makes them.
- ``tiny_model(path)``: a random-weight Llama and a locally trained tokenizer
  that vLLM loads, for end-to-end tests without a model hub.
- ``ManualClock``: a clock that moves when the test says so; pass it as
  ``CacheEngine(..., clock=...)`` and pin deadlines and the pin timer follow it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flowkv._testing.paged import make_paged_kv, random_slot_mapping
from flowkv.clock import ManualClock
from flowkv.items import RunContext
from flowkv.registry import RegistryError
from flowkv.runner import BoundStage, Runner


def run_stage(
    func: Any,
    items: Iterable[Any],
    *,
    kind: str = "store",
    ctx: RunContext | None = None,
    tracer: Any = None,
    **settings: Any,
) -> list[Any]:
    """Run one stage over ``items`` with ``settings`` (checked against its config) and collect its output."""
    info = getattr(func, "__flowkv_stage__", None)
    if info is None:
        raise RegistryError(f"{func!r} is not declared with @flowkv.stage", kind="misuse")
    config = info.make_config(**settings)
    bound = BoundStage(
        name=info.name,
        func=info.func,
        settings=info.config_kwargs(config),
        takes_ctx=info.takes_ctx,
        location="<run_stage>",
        index=0,
    )
    ctx = ctx or RunContext(kind=kind)
    try:
        return Runner([bound], kind=kind, pipeline="testing", tracer=tracer).run(items, ctx)
    finally:
        ctx.run_deferred()


def tiny_model(path: Any, **kwargs: Any) -> Any:
    """Build (once) a tiny random-weight Llama with a local tokenizer at ``path``; see
    ``flowkv._testing.tiny_model.tiny_model`` for the options."""
    from flowkv._testing.tiny_model import tiny_model as build

    return build(path, **kwargs)


__all__ = ["ManualClock", "make_paged_kv", "random_slot_mapping", "run_stage", "tiny_model"]
