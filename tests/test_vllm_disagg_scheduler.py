"""Disaggregated prefill in the connector's scheduler side: the roles, and the params between the two.

vLLM's own ``Request`` objects and a worker ``CacheEngine`` answering lookups in
this process, as in ``test_vllm_scheduler.py``; nothing starts vLLM (real
instances through ``flowkv route``: ``test_vllm_disagg.py``). A prefill instance
(``kv_producer``) stores and never looks up; a decode instance
(``kv_consumer``) loads and never stores, and waits ("ask again later") for the
KV its prefill instance said it committed.
"""

from __future__ import annotations

import time

import torch
import vllm  # noqa: F401 - a broken vLLM install fails these tests; it never skips them

from test_vllm_scheduler import (BLOCK, CHUNK, carry_out_saves, output, scheduler, store, tokens, vllm_request,
                                 worker_engine)
from test_vllm_scheduler import vllms_root_hash  # noqa: F401 - autouse here too: vLLM's root hash set for each test

from flowkv.integration.vllm.disagg import COMMITTED_TOKENS, committed_tokens, prefill_answer

PROMPT = tokens(6 * CHUNK + 40, seed=11)
ASKS_FOR_DECODE = {"do_remote_decode": True, "do_remote_prefill": False}


def prefill(connector, request):
    """Run a request's whole prompt in one step on ``connector``: the step's metadata."""
    connector.update_state_after_alloc(request, None, 0)
    blocks = list(range(len(request.prompt_token_ids) // BLOCK + 1))
    meta = connector.build_connector_meta(output(new=[(request, 0, blocks)],
                                                 scheduled={request.request_id: request.num_tokens}))
    return meta


def test_a_prefill_instance_stores_never_loads_and_names_what_it_committed():
    engine = worker_engine()
    store(engine, PROMPT[: 2 * CHUNK])  # held already: a kv_both instance would load it
    producer = scheduler(engine, role="kv_producer")
    request = vllm_request("p", PROMPT, kv_transfer_params=ASKS_FOR_DECODE)
    assert producer.get_num_new_matched_tokens(request, 0) == (0, False)
    assert producer._lookup_client.lookups == []
    meta = prefill(producer, request)
    assert meta.loads == [] and [save.token_start + len(save.token_ids) for save in meta.saves] == [6 * CHUNK]
    carry_out_saves(engine, meta)
    assert engine.lookup(torch.tensor(PROMPT)) == 6 * CHUNK
    delay, params = producer.request_finished(request, [])
    assert delay is False and params == prefill_answer(6 * CHUNK)
    assert params == {"do_remote_prefill": True, "do_remote_decode": False, COMMITTED_TOKENS: 6 * CHUNK}
    # A request that did not ask for a remote decode gets no params.
    plain = vllm_request("plain", PROMPT)
    prefill(producer, plain)
    assert producer.request_finished(plain, []) == (False, None)


def test_a_decode_instance_loads_never_stores():
    engine = worker_engine()
    store(engine, PROMPT)
    consumer = scheduler(engine, role="kv_consumer")
    request = vllm_request("d", PROMPT)
    assert consumer.get_num_new_matched_tokens(request, 0) == (6 * CHUNK, False)
    consumer.update_state_after_alloc(request, None, 6 * CHUNK)
    blocks = list(range(len(PROMPT) // BLOCK + 1))
    meta = consumer.build_connector_meta(output(new=[(request, 6 * CHUNK, blocks)], scheduled={"d": 40}))
    assert len(meta.loads) == 1 and meta.saves == []
    assert consumer.request_finished(request, []) == (False, None)


def test_a_decode_request_asks_again_later_until_the_tier_holds_what_its_prefill_committed():
    engine = worker_engine()
    store(engine, PROMPT[: 2 * CHUNK])  # a write-behind tier: part of the prompt is there so far
    consumer = scheduler(engine, role="kv_consumer")
    request = vllm_request("d", PROMPT, kv_transfer_params=prefill_answer(6 * CHUNK))
    waits = 0
    while (answer := consumer.get_num_new_matched_tokens(request, 0)) == (None, False):
        waits += 1
        if waits == 3:
            store(engine, PROMPT)  # the rest lands
        time.sleep(0.02)  # vLLM's next step
    assert waits >= 3 and answer == (6 * CHUNK, False)
    # While it waited it held no pins; now it holds the hit's, for the load vLLM will accept.
    assert engine.stats()["tiers"]["memory"]["pinned_objects"] == 6
    # vLLM asked on every step; the workers were asked at most once per poll interval.
    assert 3 <= len(consumer._lookup_client.lookups) <= waits + 1
    # Counted once, however often it was asked.
    assert engine.stats()["lookup_requested_tokens"] == 6 * CHUNK


def test_a_decode_request_waits_within_the_bound_then_loads_what_is_there():
    engine = worker_engine()
    store(engine, PROMPT[: 2 * CHUNK])
    consumer = scheduler(engine, role="kv_consumer", remote_prefill_wait_ms=100)
    request = vllm_request("d", PROMPT, kv_transfer_params=prefill_answer(6 * CHUNK))
    started = time.monotonic()
    while (answer := consumer.get_num_new_matched_tokens(request, 0)) == (None, False):
        time.sleep(0.01)
    assert time.monotonic() - started >= 0.1
    assert answer == (2 * CHUNK, False)


def test_a_decode_request_whose_prefill_committed_no_more_than_the_tier_holds_does_not_wait():
    engine = worker_engine()
    store(engine, PROMPT)
    consumer = scheduler(engine, role="kv_consumer")
    # Committed past the prompt (the prefill saw another prompt): what the prompt has is enough.
    for n, params in enumerate([prefill_answer(6 * CHUNK), prefill_answer(50 * CHUNK), prefill_answer(0)]):
        request = vllm_request(f"d{n}", PROMPT, kv_transfer_params=params)
        assert consumer.get_num_new_matched_tokens(request, 0) == (6 * CHUNK, False)


def test_params_from_the_client_that_are_not_a_token_count_are_ignored():
    for value in ("12", -1, True, 1.5, None, [3]):
        assert committed_tokens({"do_remote_prefill": True, COMMITTED_TOKENS: value}) is None
    assert committed_tokens({COMMITTED_TOKENS: 128}) is None  # not a remote prefill
    assert committed_tokens(None) is None
    engine = worker_engine()
    consumer = scheduler(engine, role="kv_consumer")
    request = vllm_request("d", PROMPT, kv_transfer_params={"do_remote_prefill": True, COMMITTED_TOKENS: "lots"})
    assert consumer.get_num_new_matched_tokens(request, 0) == (0, False)

