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
counted. Whoever can write the namespace can write anything there, so a value
is read no further than ``max_value_bytes`` (one byte more, with
``GETRANGE``): a longer one is corrupt, a miss, and costs no more memory than
that.

With ``rediss://`` the server's certificate and host name are checked
(redis-py 6 and later); ``tls_cert_file``/``tls_key_file`` give a client
certificate to servers that ask for one. A password (in the URL or in
``password``) never appears in a message, a ``repr`` or ``flowkv show``.

TOML::

    [tiers.remote]
    kind = "redis"
    url = "rediss://cache.internal:6380/0"   # redis:// plain, rediss:// TLS
    username = "flowkv"                      # optional (ACL user)
    password = "..."                         # optional; overrides the URL's
    namespace = "llama3-8b-prod"
    cluster = true                           # omit to detect with INFO cluster
    ttl_s = 86400                            # optional expiry
    tls_ca_file = "/etc/flowkv/ca.pem"       # rediss:// with a private CA
    tls_cert_file = "/etc/flowkv/client.pem" # a client certificate, when the server asks for one
    tls_key_file = "/etc/flowkv/client.key"
    max_value_bytes = "512MiB"               # a longer value is corrupt (a miss)
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


def redact(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``: for messages and ``repr``."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # not even a URL (a bad port...): say nothing of what it holds past the scheme
        return url.split("://", 1)[0] + "://***" if "://" in url else "***"
    if password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


def _check_url(instance: object, attribute: attrs.Attribute, value: str) -> None:
    try:
        parts = urlsplit(value)
        scheme, host, _port = parts.scheme, parts.hostname, parts.port
    except ValueError:  # a port that is not a number, an unclosed [
        scheme = host = None
    if scheme not in _SCHEMES or not host:
        raise ValueError(f"redis tier url must look like redis://HOST:PORT or rediss://HOST:PORT, "
                         f"got {redact(value)!r}")


def _check_namespace(instance: object, attribute: attrs.Attribute, value: str) -> None:
    # Braces would make a Redis Cluster hash tag and pin every key to one shard.
    if not value or any(c in value for c in "{}") or not value.isprintable() or " " in value:
        raise ValueError(
            f"redis tier namespace must be a non-empty printable name without spaces or braces, got {value!r}"
        )


def _positive_or_none(instance: object, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"redis tier {attribute.name} must be > 0 when set, got {value!r}")


def _positive_size(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not value > 0:
        raise ValueError(f"redis tier {attribute.name} must be > 0, got {value!r}")


@attrs.define(frozen=True, kw_only=True)
class RedisTierConfig:
    """Settings of a :class:`RedisTier`."""

    def __attrs_post_init__(self) -> None:
        tls_files = [name for name in ("tls_ca_file", "tls_cert_file", "tls_key_file") if getattr(self, name)]
        if tls_files and urlsplit(self.url).scheme != "rediss":
            raise ValueError(f"redis tier {', '.join(tls_files)} need a rediss:// url, got {redact(self.url)!r}")
        if self.tls_key_file and not self.tls_cert_file:
            raise ValueError("redis tier tls_key_file needs tls_cert_file")

    #: ``redis://[user:pass@]host:port[/db]``, or ``rediss://`` for TLS. In a
    #: cluster, any one node; the others are discovered.
    url: str = attrs.field(default="redis://127.0.0.1:6379", validator=_check_url, repr=redact)
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
    #: A client certificate (PEM) for ``rediss://`` servers that require one (``tls-auth-clients yes``).
    tls_cert_file: str | None = None
    #: The client certificate's private key (PEM; default: in ``tls_cert_file``).
    tls_key_file: str | None = None
    #: A value longer than this is corrupt (a miss), and is read no further.
    max_value_bytes: int = attrs.field(default=512 << 20, validator=_positive_size)
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
            ("hits", "misses", "corrupt", "read_bytes", "writes", "written_bytes", "connects", "reconnects",
             "too_large"), 0
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
        # One byte past the cap tells a value that is too long, without reading it all. A missing key
        # reads as b"" (GETRANGE cannot say nil), and so does an empty value: no payload is empty.
        cap = self.config.max_value_bytes
        values = [value or None for value in await self._pipelined(
            [("GETRANGE", self.storage_key(key), 0, cap) for key in keys])]
        present = [value for value in values if value is not None and len(value) <= cap]
        # Checksums of megabyte payloads are CPU work: off the event loop.
        intact = await anyio.to_thread.run_sync(lambda: [verify_payload(value) for value in present])
        verdicts = iter(intact)
        results: list[bytes | None] = []
        for key, value in zip(keys, values):
            if value is not None and (len(value) > cap or not next(verdicts)):
                logger.warning("redis tier %r: corrupt value for %s ignored%s", self.name, self.storage_key(key),
                               f" (longer than max_value_bytes = {cap})" if len(value) > cap else "")
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
            if len(payload) > self.config.max_value_bytes:
                # It could never be read back: not worth the server's memory (the tier stays healthy).
                if self._counters["too_large"] % 100 == 0:
                    logger.warning("redis tier %r: a %d-byte payload is longer than max_value_bytes = %d; not stored",
                                   self.name, len(payload), self.config.max_value_bytes)
                self._counters["too_large"] += 1
                continue
            if self.config.ttl_s is None:
                commands.append(("SET", self.storage_key(key), payload))
            else:
                px = max(1, round(self.config.ttl_s * 1000))
                commands.append(("SET", self.storage_key(key), payload, "PX", px))
        if not commands:
            return
        await self._pipelined(commands)
        self._counters["writes"] += len(commands)
        self._counters["written_bytes"] += sum(len(command[2]) for command in commands)

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
        if urlsplit(cfg.url).scheme == "rediss":
            # Explicit, whatever a redis-py release defaults to: the certificate and the host name it names.
            options["ssl_cert_reqs"] = "required"
            options["ssl_check_hostname"] = True
            if cfg.tls_ca_file is not None:
                options["ssl_ca_certs"] = cfg.tls_ca_file
            if cfg.tls_cert_file is not None:
                options["ssl_certfile"] = cfg.tls_cert_file
                options["ssl_keyfile"] = cfg.tls_key_file or cfg.tls_cert_file
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
