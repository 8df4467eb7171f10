"""Storage tiers, the storage manager that orders them, and the tier contract.

- :class:`Tier` (a byte tier) and :class:`ObjectTier` — the contract a tier
  implements, yours too (:mod:`flowkv.tiers.base`).
- :class:`StorageManager` — the ordered tiers and the policies between them
  (:mod:`flowkv.tiers.manager`).
- :class:`MemoryTier` — chunks in a host arena (:mod:`flowkv.tiers.memory`).
- :class:`GuardedTier` — timeouts, failure counting and back-off around a byte tier.
- :class:`DiskTier` / :class:`DiskTierConfig` — one file per chunk, LRU by bytes.
- :class:`RedisTier` / :class:`RedisTierConfig` — Redis/Valkey, standalone or cluster.
- :class:`ServerTier` / :class:`ServerTierConfig` — a node server's shared arena (``flowkv server``).

Byte tiers run as ``async`` methods on the engine's anyio portal thread
(:mod:`flowkv.tiers.portal`), so slow I/O never runs on the inference thread.
"""

from typing import Any

from flowkv.tiers.base import ObjectTier, Tier, TierObject, verify_payload
from flowkv.tiers.health import GuardedTier, TierHealth

__all__ = [
    "DiskTier",
    "DiskTierConfig",
    "GuardedTier",
    "MemoryTier",
    "MemoryTierConfig",
    "ObjectTier",
    "RedisTier",
    "RedisTierConfig",
    "ServerTier",
    "ServerTierConfig",
    "StorageManager",
    "Tier",
    "TierHealth",
    "TierObject",
    "verify_payload",
]

# Tier kinds and the manager import their dependencies (redis, torch) only when asked for.
_LAZY = {
    "DiskTier": "flowkv.tiers.disk",
    "DiskTierConfig": "flowkv.tiers.disk",
    "RedisTier": "flowkv.tiers.redis",
    "RedisTierConfig": "flowkv.tiers.redis",
    "MemoryTier": "flowkv.tiers.memory",
    "MemoryTierConfig": "flowkv.tiers.memory",
    "StorageManager": "flowkv.tiers.manager",
    "ServerTier": "flowkv.tiers.server",
    "ServerTierConfig": "flowkv.tiers.server",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'flowkv.tiers' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
