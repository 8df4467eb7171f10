"""The Redis tier against real redis-server processes: standalone, cluster, TLS."""

from __future__ import annotations

import uuid

import pytest
from redis.asyncio import Redis
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError

from flowkv.registry import resolve_tier
from flowkv.tiers import GuardedTier, RedisTier, RedisTierConfig
from redis_servers import (  # noqa: F401 - fixtures are used by name
    RedisServer,
    TlsFiles,
    make_payload,
    own_redis_server,
    redis_cluster,
    redis_server,
    redis_tls_server,
)

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

KIB = 1024


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def redis_tier(url: str, *, namespace: str | None = None, **options) -> RedisTier:
    # A fresh namespace per test: tests share the session's servers.
    config = RedisTierConfig(url=url, namespace=namespace or f"test-{uuid.uuid4().hex[:12]}", **options)
    return RedisTier(name="remote", config=config)


def chunk_key(i: int) -> str:
    return f"tiny-llama/1.0/bfloat16/fp/-/{i:064x}"


async def round_trip(tier: RedisTier) -> None:
    entries = [(chunk_key(i), make_payload(8 * KIB + i, seed=i)) for i in range(20)]
    await tier.put(entries)
    keys = [key for key, _ in entries]
    assert await tier.exists(keys + [chunk_key(999)]) == [True] * 20 + [False]
    assert await tier.get(keys + [chunk_key(999)]) == [payload for _, payload in entries] + [None]
    stats = tier.stats()
    assert (stats["hits"], stats["misses"], stats["writes"]) == (20, 1, 20)
    assert await tier.exists([]) == [] and await tier.get([]) == []


async def test_standalone_round_trip(redis_server: RedisServer) -> None:
    tier = redis_tier(redis_server.url)
    try:
        await round_trip(tier)
        assert tier.is_cluster is False
    finally:
        await tier.aclose()


async def test_cluster_round_trip_is_detected(redis_cluster) -> None:
    tier = redis_tier(redis_cluster.url)
    try:
        await round_trip(tier)
        assert tier.is_cluster is True
    finally:
        await tier.aclose()


async def test_cluster_spreads_keys_over_all_masters(redis_cluster) -> None:
    tier = redis_tier(redis_cluster.url, cluster=True)
    try:
        keys = [chunk_key(i) for i in range(60)]
        await tier.put([(key, make_payload(256, seed=i)) for i, key in enumerate(keys)])
    finally:
        await tier.aclose()
    node = redis_cluster.nodes[0]
    slots = {int(node.cli("CLUSTER", "KEYSLOT", tier.storage_key(key))) for key in keys}
    assert len(slots) > 50  # no shared hash tag: one slot per key, nearly always
    per_master = [int(n.cli("DBSIZE")) for n in redis_cluster.nodes]
    assert all(count > 0 for count in per_master), per_master


async def test_braces_in_keys_do_not_form_hash_tags(redis_cluster) -> None:
    tier = redis_tier(redis_cluster.url)
    try:
        keys = [f"model/{{tenant}}/{i}" for i in range(30)] + ["100%", "100%25"]
        entries = [(key, make_payload(300, seed=i)) for i, key in enumerate(keys)]
        await tier.put(entries)
        assert await tier.get(keys) == [payload for _, payload in entries]
    finally:
        await tier.aclose()
    stored = [tier.storage_key(key) for key in keys]
    assert not any("{" in key or "}" in key for key in stored)
    assert len(set(stored)) == len(keys)
    slots = {redis_cluster.nodes[0].cli("CLUSTER", "KEYSLOT", key) for key in stored}
    assert len(slots) > 20


async def test_namespaces_never_see_each_other(redis_server: RedisServer) -> None:
    prod, staging = redis_tier(redis_server.url, namespace="prod"), redis_tier(redis_server.url, namespace="staging")
    try:
        key = chunk_key(1)
        await prod.put([(key, make_payload(KIB, seed=1))])
        assert await staging.exists([key]) == [False]
        assert await staging.get([key]) == [None]
        await staging.put([(key, make_payload(KIB, seed=2))])
        assert await prod.get([key]) == [make_payload(KIB, seed=1)]
        assert await staging.get([key]) == [make_payload(KIB, seed=2)]
        assert prod.storage_key(key).startswith("prod:") and staging.storage_key(key).startswith("staging:")
    finally:
        await prod.aclose()
        await staging.aclose()


async def test_flipped_and_truncated_values_are_misses(redis_server: RedisServer) -> None:
    tier = redis_tier(redis_server.url)
    flipped, truncated, good = chunk_key(1), chunk_key(2), chunk_key(3)
    await tier.put([(k, make_payload(4 * KIB, seed=i)) for i, k in enumerate((flipped, truncated, good))])
    raw = Redis.from_url(redis_server.url)
    try:
        value = bytearray(await raw.get(tier.storage_key(flipped)))
        value[-1] ^= 0x80
        await raw.set(tier.storage_key(flipped), bytes(value))
        value = await raw.get(tier.storage_key(truncated))
        await raw.set(tier.storage_key(truncated), value[: len(value) // 2])

        assert await tier.get([flipped, truncated, good]) == [None, None, make_payload(4 * KIB, seed=2)]
        stats = tier.stats()
        assert (stats["corrupt"], stats["misses"], stats["hits"]) == (2, 2, 1)
    finally:
        await raw.aclose()
        await tier.aclose()


async def test_ttl_is_set_only_when_asked(redis_server: RedisServer) -> None:
    expiring, lasting = redis_tier(redis_server.url, ttl_s=60), redis_tier(redis_server.url)
    raw = Redis.from_url(redis_server.url)
    try:
        await expiring.put([(chunk_key(1), make_payload(100))])
        await lasting.put([(chunk_key(1), make_payload(100))])
        assert 0 < await raw.pttl(expiring.storage_key(chunk_key(1))) <= 60_000
        assert await raw.pttl(lasting.storage_key(chunk_key(1))) == -1
    finally:
        await raw.aclose()
        await expiring.aclose()
        await lasting.aclose()


async def test_acl_user_and_password(tmp_path) -> None:
    server = RedisServer(tmp_path / "auth", extra_args=("--requirepass", "s3cret")).start()
    try:
        server.cli("-a", "s3cret", "--no-auth-warning", "ACL", "SETUSER", "flowkv", "on", ">kv-pass", "~*", "+@all")
        tier = redis_tier(server.url, username="flowkv", password="kv-pass")
        await round_trip(tier)
        await tier.aclose()

        in_url = redis_tier(f"redis://flowkv:kv-pass@127.0.0.1:{server.port}")
        await in_url.put([(chunk_key(1), make_payload(100))])
        assert await in_url.get([chunk_key(1)]) == [make_payload(100)]
        await in_url.aclose()

        wrong = redis_tier(server.url, username="flowkv", password="nope")
        with pytest.raises(AuthenticationError):
            await wrong.get([chunk_key(1)])
        guarded = GuardedTier(wrong, timeout_s=5.0)
        assert await guarded.get([chunk_key(1)]) == [None]
        assert guarded.stats()["failures"] == 1
        await guarded.aclose()
    finally:
        server.stop()


async def test_tls_round_trip(redis_tls_server: RedisServer) -> None:
    assert redis_tls_server.url.startswith("rediss://")
    tier = redis_tier(redis_tls_server.url, tls_ca_file=str(redis_tls_server.tls.ca_cert))
    try:
        await round_trip(tier)
    finally:
        await tier.aclose()


async def test_a_server_asking_for_a_client_certificate_gets_one_and_host_names_are_checked(tmp_path) -> None:
    tls = TlsFiles.create(tmp_path / "pki")
    server = RedisServer(tmp_path / "mtls", tls=tls, extra_args=("--tls-auth-clients", "yes")).start()
    try:
        with_cert = redis_tier(server.url, tls_ca_file=str(tls.ca_cert), tls_cert_file=str(tls.client_cert),
                               tls_key_file=str(tls.client_key))
        await round_trip(with_cert)
        await with_cert.aclose()
        # No client certificate: the server hangs up; a guarded tier answers a miss.
        without = GuardedTier(redis_tier(server.url, tls_ca_file=str(tls.ca_cert)), timeout_s=5.0)
        assert await without.get([chunk_key(1)]) == [None] and without.stats()["failures"] == 1
        await without.aclose()
        # The certificate names 127.0.0.1; "localhost" reaches the same server but is not that name.
        by_name = redis_tier(f"rediss://localhost:{server.port}", tls_ca_file=str(tls.ca_cert),
                             tls_cert_file=str(tls.client_cert), tls_key_file=str(tls.client_key))
        with pytest.raises(RedisConnectionError, match="(?i)hostname|match"):
            await by_name.get([chunk_key(1)])
        await by_name.aclose()
    finally:
        server.stop()


async def test_a_value_longer_than_max_value_bytes_is_a_corrupt_miss(redis_server: RedisServer) -> None:
    payload = make_payload(64 * KIB)
    roomy = redis_tier(redis_server.url)
    tight = redis_tier(redis_server.url, namespace=roomy.config.namespace, max_value_bytes=len(payload) - 1)
    try:
        await roomy.put([(chunk_key(1), payload)])
        assert await tight.get([chunk_key(1), chunk_key(2)]) == [None, None]
        assert tight.stats()["corrupt"] == 1 and tight.stats()["misses"] == 2 and tight.stats()["read_bytes"] == 0
        assert await roomy.get([chunk_key(1)]) == [payload]  # the honest reader with room still hits
        # Too long to be read back: not stored, counted, no error (the tier stays healthy).
        await tight.put([(chunk_key(3), payload), (chunk_key(4), make_payload(KIB))])
        assert tight.stats()["too_large"] == 1 and tight.stats()["writes"] == 1
        assert await roomy.exists([chunk_key(3), chunk_key(4)]) == [False, True]
    finally:
        await roomy.aclose()
        await tight.aclose()


def test_a_password_is_never_shown(tmp_path, capsys) -> None:
    from flowkv.cli import main
    from flowkv.pipeline import PipelineError, builtin_pipelines, load_pipeline

    for url in ("http://flowkv:s3cret@127.0.0.1:6379", "redis://flowkv:s3cret@", "redis://flowkv:s3cret@h:port",
                "redis://:s3cret@[::1"):
        with pytest.raises(ValueError) as caught:
            RedisTierConfig(url=url)
        assert "s3cret" not in str(caught.value) and "***" in str(caught.value), url
    with pytest.raises(ValueError) as caught:
        RedisTierConfig(url="redis://flowkv:s3cret@127.0.0.1:6379", tls_ca_file="/ca.pem")
    assert "rediss://" in str(caught.value) and "s3cret" not in str(caught.value)
    config = RedisTierConfig(url="rediss://flowkv:s3cret@cache:6380/0", password="pa55")
    assert "s3cret" not in repr(config) and "pa55" not in repr(config) and "flowkv:***@cache:6380" in repr(config)

    # In a pipeline file: neither the loader's error nor `flowkv show` prints it.
    text = builtin_pipelines()["cpu-redis"].read_text()
    good = tmp_path / "good.toml"
    url_line = 'url = "redis://127.0.0.1:6379"'
    assert url_line in text
    good.write_text(text.replace(url_line, 'url = "redis://flowkv:s3cret@cache:6379"\npassword = "pa55"', 1))
    assert main(["pipeline", "show", str(good)]) == 0
    shown = capsys.readouterr().out
    assert "s3cret" not in shown and "pa55" not in shown and "redis://flowkv:***@cache:6379" in shown
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace(url_line, 'url = "http://flowkv:s3cret@cache"', 1))
    with pytest.raises(PipelineError) as caught:
        load_pipeline(str(bad))
    assert "s3cret" not in str(caught.value) and f"{bad}:" in str(caught.value)


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="redis://HOST:PORT"):
        RedisTierConfig(url="http://127.0.0.1:6379")
    with pytest.raises(ValueError, match="namespace"):
        RedisTierConfig(namespace="{pinned}")
    with pytest.raises(ValueError, match="namespace"):
        RedisTierConfig(namespace="")
    with pytest.raises(ValueError, match="ttl_s"):
        RedisTierConfig(ttl_s=0)
    assert "s3cret" not in repr(RedisTierConfig(password="s3cret"))


def test_redis_is_a_registered_tier_kind() -> None:
    info = resolve_tier("redis")
    assert info.cls is RedisTier and info.config_cls is RedisTierConfig


async def test_real_payloads_are_checked_by_default(redis_server: RedisServer) -> None:
    torch = pytest.importorskip("torch")
    from flowkv import payload

    config = RedisTierConfig(url=redis_server.url, namespace=f"test-{uuid.uuid4().hex[:12]}")
    tier = RedisTier(name="remote", config=config)
    kv = torch.ones(2, 2, 16, 4, 8, dtype=torch.bfloat16)
    good, bad = payload.encode(kv, "none"), bytearray(payload.encode(kv * 2, "none"))
    bad[40] ^= 0x01  # inside the header: its checksum catches it
    await tier.put([(chunk_key(1), good), (chunk_key(2), bytes(bad))])
    got = await tier.get([chunk_key(1), chunk_key(2)])
    await tier.aclose()
    assert got[1] is None and tier.stats()["corrupt"] == 1
    assert torch.equal(payload.decode(got[0]), kv)


async def test_a_restarted_server_is_used_again_at_once(own_redis_server: RedisServer) -> None:
    # Connections pooled before the restart are dead; the next call must not fail on them.
    tier = redis_tier(own_redis_server.url)
    try:
        await tier.put([(chunk_key(0), make_payload(2048, seed=0))])
        assert await tier.exists([chunk_key(0)]) == [True]
        own_redis_server.kill()
        own_redis_server.start()  # same port, empty (nothing is persisted)
        assert await tier.exists([chunk_key(0)]) == [False]
        await tier.put([(chunk_key(1), make_payload(2048, seed=1))])
        assert await tier.get([chunk_key(1)]) == [make_payload(2048, seed=1)]
        assert tier.stats()["reconnects"] == 1
    finally:
        await tier.aclose()
