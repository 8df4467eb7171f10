"""Disaggregated prefill through one node server: real ``vllm serve`` processes behind ``flowkv route``.

Two eager engines for the whole module, float32 (greedy tokens do not flip
with the batch a request lands in): a prefill instance (``kv_role
kv_producer``) and a decode instance (``kv_consumer``), started with the
README's "Disaggregated prefill" transfer configs (the built-in ``node-pd``
pipeline, chunks of one block) on one ``flowkv server``. The reference answer
to a prompt is the prefill instance's own, asked directly with a tag of its own
and ``flowkv.skip_save``: a producer computes every prompt and never loads
(its counters are checked at each ask), and it stores nothing of the
reference asks (the unconnected servers of test_vllm_serve and
test_vllm_matrix show that a connected engine computes what an unconnected
one does). Clients talk to ``flowkv route --prefill P --decode D``. In order:

1. Completions, streamed or not, and chat: outputs equal the plain server's;
   the decode instance computes at most one block of each prompt (vLLM's own
   ``prompt_tokens_by_source`` counters), the rest it loads.
2. A decode request that arrives before its prefill (as when a write-behind
   tier has not committed yet): the connector answers vLLM "ask again later"
   (``None``) and vLLM's scheduler keeps the request waiting and asks again
   (``vllm/v1/core/sched/scheduler.py``: ``ext_tokens is None`` ->
   ``skip_request``); this test fails if vLLM stops doing that: the request
   would compute its prompt, or fail.
3. The prefill instance killed with SIGKILL while requests are in flight:
   every request is still answered, correctly (the decode instance computes
   what was not prefilled), and the node server keeps no room or read of it.
4. Across machines: a prefill and a decode instance on ``cpu-redis`` (chunks of
   one block), Redis written behind: the decode instance waits until Redis
   holds what the prefill committed, and computes at most one block.
   (Two more engines; the reference is that prefill instance's.)
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import vllm  # noqa: F401 - a broken vLLM install fails these tests; it never skips them

from node_servers import node_servers, wait_for  # noqa: F401 - pytest fixture
from redis_servers import redis_server  # noqa: F401 - pytest fixture
from vllm_helpers import BLOCK_SIZE, random_tokens
from vllm_server import (MODEL_NAME, REDIS_PATIENCE, REFERENCE_ASK, VllmServer, _join_stream, _sse_events, metric_value,
                         readme_transfer_configs, start_servers)

from flowkv.integration.vllm.disagg import prefill_answer

pytestmark = [pytest.mark.vllm, pytest.mark.in_order]

LEASE_S = 5.0
# Prompt lengths: inside a block, one token past one, exactly on a boundary, several blocks and a tail.
LENGTHS = (300, 1025, 1024, 1777)
PROMPTS = {n: random_tokens(5000 + n, n) for n in LENGTHS}
MAX_TOKENS = 12
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"
WORDS = "the cache keeps what a model computed for a prompt and hands it back when another shares it".split()


def readme_role_config(role: str) -> dict:
    """The --kv-transfer-config of the README's ``vllm serve`` line in ``role`` ("Disaggregated prefill")."""
    [config] = [config for config in readme_transfer_configs() if config["kv_role"] == role]
    return config


def instance_options(*, core: int, role: str, kv_extra: dict | None = None, template: Path) -> dict:
    """The options of an eager float32 ``vllm serve`` on one core, flowkv's connector as the README's line
    in ``role`` starts it (its pipeline), plus ``kv_extra``.

    One core each, as one would deploy them: a decode instance waiting for its prefill spins (vLLM
    steps it every millisecond, its worker polls for the next step), and a prefill instance whose
    OpenMP threads share that core waits at every barrier for the one the spinning worker crowds
    out: here a 1,200-token prefill took over five minutes that way."""
    return {"kv_extra": kv_extra or {}, "transfer": readme_role_config(role), "compiled": False,
            "dtype": "float32", "args": ["--chat-template", str(template)],
            "env": {"VLLM_CPU_OMP_THREADS_BIND": str(core)}}


@pytest.fixture(scope="module")
def node(node_servers):  # noqa: F811 - the fixture imported above
    return node_servers("pd", memory="256MiB", lease_timeout_s=LEASE_S)


@pytest.fixture(scope="module")
def instances(node, tmp_path_factory):
    folder = tmp_path_factory.mktemp("pd")
    template = folder / "chat.jinja"
    template.write_text(CHAT_TEMPLATE, encoding="utf-8")
    on_node = {"tiers.node.socket": str(node.socket)}  # the pipeline is the README's
    started = start_servers(folder, {
        "prefill": instance_options(core=0, role="kv_producer", kv_extra=on_node, template=template),
        # Bounded far above any prefill here: test 2 holds a decode request until its prefill ran.
        "decode": instance_options(core=1, role="kv_consumer", template=template,
                           kv_extra={**on_node, "remote_prefill_wait_ms": 600_000}),
    })
    try:
        yield started
    finally:
        for server in started.values():
            server.close()


@contextlib.contextmanager
def route(prefill: VllmServer, decode: VllmServer, log: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """``flowkv route --prefill P --decode D`` on a free port: its URL and process."""
    proc = subprocess.Popen([str(Path(sys.executable).parent / "flowkv"), "route", "--port", "0",
                             "--prefill", prefill.url, "--decode", decode.url,
                             "--prefill-retry-s", "600", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=open(log, "ab"), stdin=subprocess.DEVNULL)
    try:
        line = proc.stdout.readline().decode()
        assert "listening on http://" in line, (line, log.read_text())
        url = line.split("listening on ")[1].strip()
        wait_for(lambda: _answers(url + "/health"), "flowkv route to answer")  # the line can come first
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def router(instances, tmp_path_factory):
    with route(instances["prefill"], instances["decode"], tmp_path_factory.mktemp("route") / "route.log") as (url, _):
        yield url


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status == 200
    except OSError:
        return False


def post(url: str, path: str, body: dict) -> tuple[dict, dict]:
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.load(reply), dict(reply.headers)


def complete(url: str, prompt: list[int], *, stream: bool = False, max_tokens: int = MAX_TOKENS,
             **fields) -> tuple[list[int], dict]:
    """A greedy completion's token ids (streamed ones joined), and the response's headers."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream, **fields}
    if not stream:
        reply, headers = post(url, "/v1/completions", body)
        return reply["choices"][0]["token_ids"], headers
    body["stream_options"] = {"include_usage": True}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        joined = _join_stream(_sse_events(reply))
        assert joined["done"]
        return joined["token_ids"], dict(reply.headers)


def chat(url: str, content: str, **fields) -> tuple[str, int]:
    """A greedy chat answer, and the prompt's length in tokens."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, **fields}
    reply = post(url, "/v1/chat/completions", body)[0]
    return reply["choices"][0]["message"]["content"], reply["usage"]["prompt_tokens"]


def reference(producer: VllmServer, prompt: list[int]) -> list[int]:
    """The greedy answer of a prefill instance to ``prompt``, computed whole and stored nowhere."""
    before = by_source(producer)
    output, _ = complete(producer.url, prompt, kv_transfer_params=REFERENCE_ASK)
    assert counted(producer, before, len(prompt)) == {"local_compute": len(prompt), "external_kv_transfer": 0}
    return output


def reference_chat(producer: VllmServer, content: str) -> tuple[str, int]:
    """``chat`` asked of a prefill instance directly, as ``reference`` asks."""
    before = by_source(producer)
    answer, n = chat(producer.url, content, kv_transfer_params=REFERENCE_ASK)
    assert counted(producer, before, n) == {"local_compute": n, "external_kv_transfer": 0}
    return answer, n


def by_source(instance: VllmServer) -> dict[str, float]:
    """vLLM's prompt tokens by where they came from: computed here, or loaded (flowkv's hits)."""
    text = instance.metrics()
    return {source: metric_value(text, "vllm:prompt_tokens_by_source_total", source=source)
            for source in ("local_compute", "external_kv_transfer")}


def loaded_tokens(n: int) -> int:
    """What the decode instance loads of an n-token prompt: all whole blocks before its last token."""
    return (n - 1) // BLOCK_SIZE * BLOCK_SIZE


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before[key] for key in after}


def counted(instance: VllmServer, before: dict[str, float], tokens: int) -> dict[str, float]:
    """The change in ``instance``'s prompt-token counters once it counted ``tokens`` more."""
    return wait_for(lambda: (d := delta(by_source(instance), before)) and sum(d.values()) >= tokens and d,
                    f"{instance.url} to count {tokens} prompt tokens", timeout_s=120)


def test_completions_through_the_router_equal_the_reference_and_decode_computes_at_most_a_block(
        instances, router):
    prefill, decode = instances["prefill"], instances["decode"]
    for n, prompt in PROMPTS.items():
        expected = reference(prefill, prompt)
        at_prefill, at_decode = by_source(prefill), by_source(decode)
        output, headers = complete(router, prompt)
        assert output == expected, n
        assert headers["x-flowkv-prefill"] == prefill.url and headers["x-flowkv-backend"] == decode.url
        # The prefill instance computed the whole prompt (a producer never loads); the decode
        # instance loaded all of it but the block holding its last token.
        assert counted(prefill, at_prefill, n) == {"local_compute": n, "external_kv_transfer": 0}
        assert counted(decode, at_decode, n) == {"local_compute": n - loaded_tokens(n),
                                                 "external_kv_transfer": loaded_tokens(n)}
        assert 0 < n - loaded_tokens(n) <= BLOCK_SIZE
    # A producer stores, a consumer only loads.
    assert prefill.metric("vllm:flowkv_stored_tokens_total") >= sum(n // BLOCK_SIZE * BLOCK_SIZE for n in LENGTHS)
    assert decode.metric("vllm:flowkv_stored_tokens_total") == 0
    assert decode.metric("vllm:flowkv_retrieved_tokens_total") >= sum(loaded_tokens(n) for n in LENGTHS)


def test_streamed_completions_and_chat_through_the_router_equal_the_reference(instances, router):
    decode = instances["decode"]
    prompt = random_tokens(6001, 1400)
    expected = reference(instances["prefill"], prompt)
    at_decode = by_source(decode)
    output, headers = complete(router, prompt, stream=True)
    assert output == expected and headers["x-flowkv-prefill"] == instances["prefill"].url
    assert counted(decode, at_decode, 1400)["local_compute"] <= BLOCK_SIZE

    content = " ".join(WORDS[i % len(WORDS)] for i in range(400))
    at_decode = by_source(decode)
    answer, n = chat(router, content)
    assert (answer, n) == reference_chat(instances["prefill"], content) and n > 4 * BLOCK_SIZE
    assert counted(decode, at_decode, n) == {"local_compute": n - loaded_tokens(n),
                                             "external_kv_transfer": loaded_tokens(n)}


def test_a_decode_request_that_arrives_before_its_prefill_is_asked_again_until_the_kv_is_there(
        node, instances, router):
    prefill, decode = instances["prefill"], instances["decode"]
    n = 1200
    prompt = random_tokens(6002, n)
    expected = reference(prefill, prompt)
    at_decode = by_source(decode)
    lookups = node.status()["requests"].get("lookups", 0)
    done: dict[str, list[int]] = {}
    # What the prefill instance will name: the prompt's whole blocks (node-pd's chunks).
    params = prefill_answer(n // BLOCK_SIZE * BLOCK_SIZE)
    waiting = threading.Thread(target=lambda: done.update(out=complete(decode.url, prompt,
                                                                       kv_transfer_params=params)[0]))
    waiting.start()
    # The decode instance looks for the KV again and again, computing nothing meanwhile.
    wait_for(lambda: node.status()["requests"].get("lookups", 0) - lookups >= 5, "the decode request to keep asking",
             timeout_s=120)
    assert waiting.is_alive() and delta(by_source(decode), at_decode)["local_compute"] == 0
    answer, _ = post(prefill.url, "/v1/completions", {
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}})
    assert answer["kv_transfer_params"]["flowkv_committed_tokens"] == params["flowkv_committed_tokens"]
    waiting.join(600)
    assert done["out"] == expected
    assert counted(decode, at_decode, n) == {"local_compute": n - loaded_tokens(n),
                                             "external_kv_transfer": loaded_tokens(n)}


def test_the_router_killed_mid_request_loses_that_request_only(node, instances, router, tmp_path):
    """``flowkv route`` killed with SIGKILL while a request's decode streams: that client's connection
    breaks; the instances drop the request and keep nothing of it pinned or leased, and the same
    prompt through another router is answered correctly, its decode leg loading all but a block."""
    prefill, decode = instances["prefill"], instances["decode"]
    prompt = random_tokens(6003, 1300)
    failed: list[BaseException] = []

    def ask(url: str) -> None:
        try:  # ~2,000 greedy tokens: seconds of streaming, well past the kill
            complete(url, prompt, stream=True, max_tokens=2000)
        except BaseException as exc:  # noqa: BLE001 - what the client saw is the assertion
            failed.append(exc)

    with route(prefill, decode, tmp_path / "route.log") as (url, proc):
        client = threading.Thread(target=ask, args=(url,))
        client.start()
        wait_for(lambda: json.load(urllib.request.urlopen(url + "/stats", timeout=60))["in_flight"][decode.url] > 0,
                 "the request's decode leg in flight")
        proc.kill()
        proc.wait(timeout=60)
        client.join(600)
    assert not client.is_alive() and failed, "the client's stream should break with the router"
    # Nothing of the request is held: the decode instance drops it, then no room, read or pin of it is left in
    # the node server. Its lookup's pins go with the release the scheduler sends when the request ends (to its
    # worker, which tells the server): a moment after, and well inside the pins' own deadline (30 s), which
    # would free them without any release.
    wait_for(lambda: decode.metric("vllm:num_requests_running") == 0, "the decode instance to drop the request",
             timeout_s=120)
    wait_for(lambda: (s := node.status())["clients"]["allocations_held"] == 0 and s["clients"]["reads_held"] == 0
             and s["memory"]["pinned_entries"] == 0, "the node server to hold nothing of the dropped request",
             timeout_s=15)
    expected = reference(prefill, prompt)
    at_decode = by_source(decode)
    output, _ = complete(router, prompt)
    assert output == expected
    assert counted(decode, at_decode, 1300)["local_compute"] <= BLOCK_SIZE


def test_the_prefill_instance_killed_mid_run_leaves_every_request_answered_correctly(node, instances, router):
    prefill = instances["prefill"]
    prompts = [random_tokens(7000 + i, 2500 + 37 * i) for i in range(8)]
    expected = [reference(prefill, prompt) for prompt in prompts]
    after_kill = reference(prefill, PROMPTS[1777])  # asked of the decode instance alone, after the kill
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = [pool.submit(complete, router, prompt) for prompt in prompts]
        # Killed as soon as the router has a prefill in flight there: eight 2,500-token prompts take seconds.
        wait_for(lambda: json.load(urllib.request.urlopen(router + "/stats", timeout=60))
                 ["prefill_in_flight"][prefill.url] > 0, "a prefill in flight")
        prefill.kill()  # SIGKILL to its API server, engine core and worker
        outputs = [reply.result(timeout=600) for reply in replies]
    assert [output for output, _ in outputs] == expected
    stats = json.load(urllib.request.urlopen(router + "/stats", timeout=60))
    assert stats["decisions"].get("prefill-failed", 0) >= 1
    assert stats["in_flight"] == {instances["decode"].url: 0} and stats["prefill_in_flight"] == {prefill.url: 0}
    # After the kill, requests skip the prefill instance and are answered all the same.
    output, headers = complete(router, PROMPTS[1777])
    assert headers["x-flowkv-prefill"] == "none"
    assert output == after_kill
    # The killed instance's leases run out: no room or read of it is left in the server.
    clients = wait_for(lambda: (c := node.status()["clients"])["allocations_held"] == 0 and c["reads_held"] == 0
                       and c, "the node server to reclaim the killed instance's leases", timeout_s=LEASE_S * 20)
    assert node.status()["memory"]["pinned_entries"] == 0 and clients["reads_held"] == 0


@pytest.fixture(scope="module")
def on_redis(instances, redis_server, tmp_path_factory):  # noqa: F811 - the fixture imported above
    folder = tmp_path_factory.mktemp("pd-redis")
    template = folder / "chat.jinja"
    template.write_text(CHAT_TEMPLATE, encoding="utf-8")
    shared = {"pipeline": "cpu-redis", "chunk_size": BLOCK_SIZE, "tiers.redis.url": redis_server.url,
              "tiers.redis.namespace": "pd-test", **REDIS_PATIENCE}
    started = start_servers(folder, {
        "prefill": instance_options(core=0, role="kv_producer", kv_extra=shared, template=template),
        "decode": instance_options(core=1, role="kv_consumer", template=template,
                           kv_extra={**shared, "remote_prefill_wait_ms": 600_000}),
    })
    try:
        with route(started["prefill"], started["decode"], folder / "route.log") as (url, _):
            yield {**started, "router": url}
    finally:
        for server in started.values():
            server.close()


def test_through_redis_the_decode_instance_loads_what_the_prefill_wrote_behind_but_a_block(instances, on_redis):
    decode = on_redis["decode"]
    for n in (700, 1537):
        prompt = random_tokens(9000 + n, n)
        expected = reference(on_redis["prefill"], prompt)
        at_decode = by_source(decode)
        output, headers = complete(on_redis["router"], prompt)
        assert output == expected and headers["x-flowkv-prefill"] == on_redis["prefill"].url
        assert counted(decode, at_decode, n) == {"local_compute": n - loaded_tokens(n),
                                                 "external_kv_transfer": loaded_tokens(n)}
    assert decode.metric("vllm:flowkv_stored_tokens_total") == 0
