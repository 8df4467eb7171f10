"""The Redis/Valkey tier: chunk payloads on an existing Redis or Valkey deployment.

Works with a standalone server and with Redis Cluster. Every key lives under
``NAMESPACE:`` so two deployments (two models, two clusters of inference
servers, a staging and a production) sharing one server never see each
other's entries. Batches go out as one pipeline (``EXISTS``/``GET``/``SET``);
in a cluster the pipeline is split per shard by the client, and keys hash
across all slots — no hash tag pins them to one shard.

Expiry and memory are the server's business: set ``ttl_s`` to give entries an
expiry, and configure ``maxmemory`` / ``maxmemory-policy`` (e.g. ``allkeys-lru``)
on the server; this tier never deletes. Every value read is checked with
:func:`flowkv.tiers.verify_payload`; a corrupt or truncated value is a miss,
counted.

TOML::

    [tiers.remote]
    kind = "redis"
    url = "rediss://cache.internal:6380/0"   # redis:// plain, rediss:// TLS
    username = "flowkv"                      # optional (ACL user)
    password = "..."                         # optional; overrides the URL's
    namespace = "llama3-8b-prod"
    cluster = true                           # omit to detect with INFO cluster
    ttl_s = 86400                            # optional expiry
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.to_thread
import attrs
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.asyncio.cluster import RedisCluster

from flowkv.registry import tier
from flowkv.tiers.base import Tier, verify_payload

__all__ = ["RedisTier", "RedisTierConfig"]

logger = logging.getLogger("flowkv.tiers")

_SCHEMES = ("redis", "rediss")


def _check_url(instance: object, attribute: attrs.Attribute, value: str) -> None:
    parts = urlsplit(value)
    if parts.scheme not in _SCHEMES or not parts.hostname:
        raise ValueError(f"redis tier url must look like redis://HOST:PORT or rediss://HOST:PORT, got {value!r}")


def _check_namespace(instance: object, attribute: attrs.Attribute, value: str) -> None:
    # Braces would make a Redis Cluster hash tag and pin every key to one shard.
    if not value or any(c in value for c in "{}") or not value.isprintable() or " " in value:
        raise ValueError(
            f"redis tier namespace must be a non-empty printable name without spaces or braces, got {value!r}"
        )


def _positive_or_none(instance: object, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"redis tier {attribute.name} must be > 0 when set, got {value!r}")


@attrs.define(frozen=True, kw_only=True)
class RedisTierConfig:
    """Settings of a :class:`RedisTier`."""

    #: ``redis://[user:pass@]host:port[/db]``, or ``rediss://`` for TLS. In a
    #: cluster, any one node; the others are discovered.
    url: str = attrs.field(default="redis://127.0.0.1:6379", validator=_check_url)
    #: ACL user name; overrides the URL's.
    username: str | None = None
    #: Password; overrides the URL's.
    password: str | None = attrs.field(default=None, repr=False)
    #: Prefix of every key (``NAMESPACE:``): deployments with different namespaces never collide.
    namespace: str = attrs.field(default="flowkv", validator=_check_namespace)
    #: Redis Cluster (true), standalone (false), or detect with ``INFO cluster`` (unset).
    cluster: bool | None = None
    #: Expiry of each stored entry in seconds; unset = no expiry (the server's
    #: maxmemory policy then decides what goes).
    ttl_s: float | None = attrs.field(default=None, validator=_positive_or_none)
    #: CA bundle for ``rediss://`` servers with a private CA.
    tls_ca_file: str | None = None
    #: Socket connect/read timeout; the health guard's own timeout is usually shorter.
    socket_timeout_s: float = attrs.field(default=5.0, validator=_positive_or_none)
    #: Connections kept per server.
    max_connections: int = 64


def _escape_key(key: str) -> str:
    # Braces inside a key would form a hash tag too; '%' is escaped first so
    # the mapping stays one-to-one.
    return key.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


@tier("redis", config=RedisTierConfig)
class RedisTier(Tier):
    """Chunk payloads in Redis/Valkey, standalone or cluster, under a namespace.

    Connects on first use (on the portal's event loop, where every later call
    runs). Connection and server failures raise; wrap the tier in
    :class:`flowkv.tiers.GuardedTier` to turn them into misses.
    """

    def __init__(
        self,
        *,
        name: str,
        config: RedisTierConfig,
    ) -> None:
        self.name = name
        self.config = config
        self._prefix = config.namespace + ":"
        self._client: Redis | RedisCluster | None = None
        self._connect_lock: anyio.Lock | None = None
        self.is_cluster: bool | None = config.cluster
        self._counters = dict.fromkeys(
            ("hits", "misses", "corrupt", "read_bytes", "writes", "written_bytes", "connects", "reconnects"), 0
        )

    def storage_key(self, key: str) -> str:
        """The Redis key that holds ``key``'s payload (namespace prefix included)."""
        if not isinstance(key, str):
            raise TypeError(f"tier keys are str (CacheKey.to_str()), got {type(key).__name__}")
        return self._prefix + _escape_key(key)

    # -- the Tier contract -------------------------------------------------

    async def exists(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        answers = await self._pipelined([("EXISTS", self.storage_key(key)) for key in keys])
        return [bool(answer) for answer in answers]

    async def get(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        values = await self._pipelined([("GET", self.storage_key(key)) for key in keys])
        present = [value for value in values if value is not None]
        # Checksums of megabyte payloads are CPU work: off the event loop.
        intact = await anyio.to_thread.run_sync(lambda: [verify_payload(value) for value in present])
        verdicts = iter(intact)
        results: list[bytes | None] = []
        for key, value in zip(keys, values):
            if value is not None and not next(verdicts):
                logger.warning("redis tier %r: corrupt value for %s ignored", self.name, self.storage_key(key))
                self._counters["corrupt"] += 1
                value = None
            if value is None:
                self._counters["misses"] += 1
            else:
                self._counters["hits"] += 1
                self._counters["read_bytes"] += len(value)
            results.append(value)
        return results

    async def put(self, entries: list[tuple[str, bytes]]) -> None:
        if not entries:
            return
        commands: list[tuple[Any, ...]] = []
        for key, payload in entries:
            if isinstance(payload, bytearray):
                payload = bytes(payload)  # the client encodes bytes and memoryview only
            elif not isinstance(payload, (bytes, memoryview)):
                raise TypeError(f"redis tier {self.name!r}: payload for {key!r} is {type(payload).__name__}, not bytes")
            if self.config.ttl_s is None:
                commands.append(("SET", self.storage_key(key), payload))
            else:
                px = max(1, round(self.config.ttl_s * 1000))
                commands.append(("SET", self.storage_key(key), payload, "PX", px))
        await self._pipelined(commands)
        self._counters["writes"] += len(entries)
        self._counters["written_bytes"] += sum(len(payload) for _, payload in entries)

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def stats(self) -> dict[str, int | float]:
        return dict(self._counters)

    # -- connection ----------------------------------------------------------

    async def _pipelined(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        try:
            return await self._send(commands)
        except RedisConnectionError:
            # Connections pooled before a server restart fail once; the commands
            # (EXISTS, GET, SET of one payload per key) are safe to send again on
            # a fresh client. A server that is really gone fails again, and raises.
            self._counters["reconnects"] += 1
            await self.aclose()
            return await self._send(commands)

    async def _send(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        client = await self._connection()
        async with client.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            return await pipe.execute()

    async def _connection(self) -> Redis | RedisCluster:
        if self._client is not None:
            return self._client
        if self._connect_lock is None:
            self._connect_lock = anyio.Lock()
        async with self._connect_lock:
            if self._client is None:
                self._client = await self._connect()
                self._counters["connects"] += 1
        return self._client

    def _client_options(self) -> dict[str, Any]:
        cfg = self.config
        options: dict[str, Any] = {
            "socket_timeout": cfg.socket_timeout_s,
            "socket_connect_timeout": cfg.socket_timeout_s,
            "max_connections": cfg.max_connections,
        }
        if cfg.username is not None:
            options["username"] = cfg.username
        if cfg.password is not None:
            options["password"] = cfg.password
        if cfg.tls_ca_file is not None:
            options["ssl_ca_certs"] = cfg.tls_ca_file
        return options

    async def _connect(self) -> Redis | RedisCluster:
        url, options = self.config.url, self._client_options()
        cluster = self.config.cluster
        if cluster is not True:
            standalone = Redis.from_url(url, **options)
            try:
                if cluster is None:
                    info = await standalone.info("cluster")
                    cluster = bool(info.get("cluster_enabled"))
                else:
                    await standalone.ping()
            except BaseException:
                await standalone.aclose()
                raise
            if not cluster:
                self.is_cluster = False
                return standalone
            await standalone.aclose()
        clustered = RedisCluster.from_url(url, **options)
        try:
            await clustered.initialize()
        except BaseException:
            await clustered.aclose()
            raise
        self.is_cluster = True
        return clustered
