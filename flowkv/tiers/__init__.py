"""Slow storage tiers: local disk and Redis/Valkey, behind a health guard.

The memory tier lives in :mod:`flowkv.memory`; the tiers here move encoded
payloads (bytes carrying the :mod:`flowkv.payload` header) and run as
``async`` methods on the engine's anyio portal thread (:mod:`flowkv.tiers.portal`),
so slow I/O never runs on the inference thread.

- :class:`Tier` — the contract a tier implements (yours too).
- :class:`GuardedTier` — timeouts, failure counting and back-off around any tier.
- :class:`DiskTier` / :class:`DiskTierConfig` — one file per chunk, LRU by bytes.
- :class:`RedisTier` / :class:`RedisTierConfig` — Redis/Valkey, standalone or cluster.
"""

from flowkv.tiers.base import Tier, verify_payload
from flowkv.tiers.disk import DiskTier, DiskTierConfig
from flowkv.tiers.health import GuardedTier, TierHealth
from flowkv.tiers.redis import RedisTier, RedisTierConfig

__all__ = [
    "DiskTier",
    "DiskTierConfig",
    "GuardedTier",
    "RedisTier",
    "RedisTierConfig",
    "Tier",
    "TierHealth",
    "verify_payload",
]
