"""The connector in vLLM's scheduler (engine-core) process: lookups, and each step's loads and saves.

flowkv's engine lives in the workers, so a lookup asks every worker over IPC
and waits at most ``[vllm] lookup_timeout_ms`` (0 hits past it). The
scheduler keeps one ``RequestState`` per request it has seen: the request's
chunk hashes (``ChunkChain``, worked out once), the workers' latest answer
and the pins it holds, the load vLLM accepted, and how far the request's
chunks were asked to be stored, so each step's ``FlowKVMetadata`` carries
only new work.

**A lookup once per request.** vLLM asks ``get_num_new_matched_tokens``
again on every step a request waits (no free blocks, the batch full) and
after a preemption. The answer is kept and given again, with its pins, as
long as the request is the same (tokens asked about, tokens vLLM computed),
the pins are well inside their timeout, and no chunk the answer missed was
stored since (the scheduler knows every chunk it asked a worker to store).
Otherwise the workers are asked again: with the chunk hashes, never the
tokens, and the workers count only tokens and hits no earlier answer for the
request counted, so ``lookup_requested_tokens`` counts each request once.

**Asynchronous loads.** When the hit lies (partly) below memory (``async_loads
= "auto"``, the default) or for every hit (``"always"``), the answer is
``(n, True)``: vLLM allocates the blocks, parks the request in
``WAITING_FOR_REMOTE_KVS`` and goes on with the batch; the worker finishes the
load once the lookup's prefetch landed and reports the request in
``get_finished``. A short asynchronous load is reported failed as well, so
vLLM looks the request up again and its cached-token count is what loaded.

**Disaggregated prefill** (``disagg.py``): on a prefill instance
``request_finished`` names the tokens stored; on a decode instance a request
carrying those params is answered ``None`` ("ask again later") while the
tiers hold less, within ``[vllm] remote_prefill_wait_ms``.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from flowkv.integration._ipc import LookupClient
from flowkv.integration.vllm.chunk_hashes import ChunkChain, VllmBlockHashes, keyed_pipeline
from flowkv.integration.vllm.disagg import committed_tokens, prefill_answer, wants_remote_decode
from flowkv.integration.vllm.kv_events import publishes_kv_events
from flowkv.integration.vllm.metadata import FlowKVMetadata, LoadSpec, SaveSpec, ceil_to, floor_to
from flowkv.integration.vllm.query import pack_hashes
from flowkv.integration.vllm.settings import ConnectorSettings, Instance, request_recompute_ratio, request_tags
from flowkv.keys import default_hash_function_name, get_hash_function

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from flowkv.pipeline_model import Pipeline

logger = logging.getLogger("flowkv.integration")

__all__ = ["ConnectorScheduler", "LookupAnswer", "RequestState"]

# Chunks the scheduler remembers asking a worker to store (to know a cached miss went stale).
_SAVED_REMEMBERED = 1 << 16
# A decode request waiting for its prefill's KV asks the workers at most this often: vLLM asks the
# connector on every step, and a step with nothing else to run comes back at once.
_REMOTE_POLL_S = 0.01


@dataclass
class LookupAnswer:
    """What the workers answered for a request, given again while vLLM asks the same."""

    # Pins this answer holds in the workers (None: released, or none taken).
    lookup_id: str | None
    # The question: tokens asked about, and the tokens vLLM had computed.
    end: int
    computed: int
    # The answer: the hit, and the part of it memory holds (the minimum over workers).
    hit_tokens: int
    memory_tokens: int
    asked_at: float  # time.monotonic()
    # The scheduler's save sequence number when asked: later saves may fill a miss.
    save_seq: int


@dataclass
class PendingLoad:
    """A load vLLM accepted (``update_state_after_alloc``) that the next metadata carries."""

    start: int
    end: int
    hit_tokens: int
    lookup_id: str | None
    load_async: bool


@dataclass
class RequestState:
    """What the scheduler connector knows of one request."""

    # vLLM's live object: all_token_ids grows as it decodes; a slice of it is a new list.
    request: Request
    tags: dict[str, str]
    skip_save: bool
    # The request's chunk hashes (None: the pipeline keys chunks by content, tokens are sent).
    chain: ChunkChain | None
    block_ids: list[int] = field(default_factory=list)
    answer: LookupAnswer | None = None
    # Whether the latest answer given to vLLM was (n, True).
    offered_async: bool = False
    # Tokens and hit tokens the workers counted for this request so far.
    counted: tuple[int, int] = (0, 0)
    pending_load: PendingLoad | None = None
    # Asynchronous loads of this request that came back short: later loads are synchronous.
    async_failures: int = 0
    # Tokens (chunk-aligned) this request asked flowkv to store.
    stored_end: int = 0
    # Tokens vLLM will have computed after the last scheduled step; fewer at
    # the next step means vLLM rolled the request back (failed load, preemption).
    expected_computed: int = 0
    # Steps in a row this request was scheduled with nothing for flowkv to do (see `_settle`).
    quiet_steps: int = 0
    # A decode request prefilled elsewhere: since when, and when last, it asked for the committed KV
    # (time.monotonic(); None: not waiting, or done waiting).
    remote_wait_since: float | None = None
    remote_asked_at: float = 0.0


def recount_short_load(request: Request, block_ids: list[int], invalid: set[int], block_size: int) -> None:
    """Count in a request's ``num_cached_tokens`` only the external tokens before its first block
    whose load failed. vLLM recomputes from that block, but its prefill stats keep the count it
    accepted at scheduling (``tests/test_vllm_blend.py`` pins both)."""
    stats = getattr(request, "prefill_stats", None)
    bad = next((index for index, block in enumerate(block_ids) if block in invalid), None)
    if stats is None or bad is None:
        return
    external = max(0, min(stats.num_external_cached_tokens, bad * block_size - stats.num_local_cached_tokens))
    if external < stats.num_external_cached_tokens:
        stats.set(num_prompt_tokens=stats.num_prompt_tokens, num_local_cached_tokens=stats.num_local_cached_tokens,
                  num_external_cached_tokens=external)


class ConnectorScheduler:
    """The scheduler side of ``FlowKVConnector``."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_transfer_config: KVTransferConfig,
        settings: ConnectorSettings,
        pipeline: Pipeline,
    ) -> None:
        self._chunk_size = pipeline.chunk_size
        self._block_size = vllm_config.cache_config.block_size
        self._save_decode = pipeline.vllm.save_decode
        self._partial_chunks = pipeline.section.save_partial_chunks
        # Blend pipelines cut requests at separators: chunks (segments) end anywhere, so lookups,
        # loads and saves reach to where the segments end, not to chunk_size boundaries.
        self._segments = pipeline.blend is not None
        self._loads = kv_transfer_config.is_kv_consumer
        self._saves = kv_transfer_config.is_kv_producer
        self._async_loads = settings.async_loads
        self._remote_prefill_wait_s = pipeline.vllm.remote_prefill_wait_ms / 1000
        # An answer is given again only well inside the pins' timeout.
        self._answer_ttl_s = pipeline.section.pin_timeout_s / 2
        self._keyed = keyed_pipeline(pipeline)
        hash_name = pipeline.section.hash
        self._hash_fn = get_hash_function(default_hash_function_name() if hash_name == "auto" else hash_name)
        self._vllm_hashes = VllmBlockHashes(vllm_config, pipeline) if self._keyed else None
        self._requests: dict[str, RequestState] = {}
        # Requests whose steps may still carry a load or a save, or show a rollback: every other
        # request is decoding with its prompt stored, and build_connector_meta skips it. A step
        # of such requests only is one check (a decoding batch pays nothing per step).
        self._attentive: set[str] = set()
        self._lookup_seq = itertools.count()
        # Chunk hash -> the save that asked for it; the sequence number counts saves.
        self._saved_at: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._save_seq = 0
        # Requests whose accepted asynchronous load the next metadata carries.
        self._async_to_send: list[RequestState] = []
        # Saves carry vLLM's block hashes when flowkv's tiers go into vLLM's KV events.
        self.publishes_kv_events = publishes_kv_events(vllm_config, pipeline)
        # vLLM reads this policy after it built the connector.
        policy = kv_transfer_config.kv_load_failure_policy
        if policy != "recompute":
            logger.info("flowkv: kv_load_failure_policy %r -> 'recompute' (a failed load is a cache miss)", policy)
            kv_transfer_config.kv_load_failure_policy = "recompute"
        instance = Instance.of(vllm_config)
        paths = [instance.socket(settings.ipc_dir, rank) for rank in range(instance.world_size)]
        self._lookup_client: LookupClient | None = LookupClient(paths, timeout_ms=pipeline.vllm.lookup_timeout_ms)

    # -- lookups ------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past ``num_computed_tokens`` flowkv can load: whole vLLM
        blocks, never the request's last token, 0 when the workers do not
        answer in time; and whether vLLM should wait for the load between steps."""
        state = self._state_for(request)
        state.offered_async = False
        num_tokens = request.num_tokens
        # The last token is always computed: its logits are the next token's.
        ceiling = floor_to(num_tokens - 1, self._block_size)
        # Only whole chunks can hit unless the pipeline stores partial ones.
        lookup_end = num_tokens if self._partial_chunks or self._segments else floor_to(num_tokens, self._chunk_size)
        if (not self._loads or ceiling <= num_computed_tokens or request.prompt_token_ids is None
                or lookup_end <= num_computed_tokens):
            self._drop_answer(state)
            return 0, False
        committed = committed_tokens(request.kv_transfer_params)
        if committed is not None and state.remote_wait_since is None and not state.counted[0]:
            state.remote_wait_since = time.monotonic()
        if state.remote_wait_since is not None and time.monotonic() - state.remote_asked_at < _REMOTE_POLL_S:
            return None, False  # asked a moment ago: vLLM asks again on its next step
        answer = state.answer
        if answer is None or not self._still_holds(state, answer, lookup_end, num_computed_tokens):
            self._drop_answer(state)
            answer = self._ask(state, lookup_end, num_computed_tokens)
            if answer is None:
                state.remote_wait_since = None
                return 0, False
        if state.remote_wait_since is not None and self._wait_for_remote(state, answer, committed, lookup_end):
            return None, False
        # Whole vLLM blocks only: a partial block would be written by the
        # load and again by the forward pass, or shared with another request.
        usable = floor_to(min(answer.hit_tokens, num_tokens - 1), self._block_size)
        if usable <= num_computed_tokens:
            # Nothing to load: no pins needed, but the answer stands (asking again would find the same).
            self._release(answer)
            return 0, False
        state.offered_async = self._load_async(state, answer, usable)
        return usable - num_computed_tokens, state.offered_async

    def _wait_for_remote(self, state: RequestState, answer: LookupAnswer, committed: int | None, end: int) -> bool:
        """Whether a decode request should wait for more of what its prefill instance committed."""
        now = time.monotonic()
        assert state.remote_wait_since is not None
        if committed is None or answer.hit_tokens >= min(committed, end):
            state.remote_wait_since = None
            return False
        if now - state.remote_wait_since >= self._remote_prefill_wait_s:
            logger.warning("flowkv: request %s: its prefill instance committed %d tokens; after %.1f s the "
                           "tiers hold %d of them, which it loads (vLLM computes the rest)",
                           state.request.request_id, committed, now - state.remote_wait_since, answer.hit_tokens)
            state.remote_wait_since = None
            return False
        # Asked again on vLLM's next step, with fresh pins.
        self._drop_answer(state)
        state.remote_asked_at = now
        return True

    def _still_holds(self, state: RequestState, answer: LookupAnswer, end: int, computed: int) -> bool:
        """Whether the workers would answer the same now (see the module docstring)."""
        if (answer.end, answer.computed) != (end, computed):
            return False
        if time.monotonic() - answer.asked_at > self._answer_ttl_s:
            return False
        if answer.hit_tokens >= end:
            return True
        if state.chain is None:
            return self._save_seq <= answer.save_seq
        # Only a store of the first chunk the answer missed can lengthen the hit.
        miss = answer.hit_tokens // self._chunk_size
        if miss >= len(state.chain.full):
            return True  # a partial chunk: the connector never stores one
        return self._saved_at.get(state.chain.full[miss], -1) <= answer.save_seq

    def _ask(self, state: RequestState, end: int, computed: int) -> LookupAnswer | None:
        """Ask every worker how much of the request's first ``end`` tokens it holds, pinning the hit."""
        assert self._lookup_client is not None
        request = state.request
        lookup_id = f"{request.request_id}#{next(self._lookup_seq)}"
        header: dict[str, Any] = {"op": "lookup", "lookup_id": lookup_id, "tags": state.tags,
                                  "counted": list(state.counted)}
        if state.chain is not None:
            header["num_tokens"] = end
            body = pack_hashes(state.chain.hashes(request, 0, end))
        else:
            body = np.asarray(request.all_token_ids[:end], dtype=np.int64)
        replies = self._lookup_client.ask(header, body)
        if replies is None or not all(reply.get("ok") for reply in replies):
            for reply in replies or ():
                if not reply.get("ok"):
                    logger.warning("flowkv: lookup failed on a worker: %s", reply.get("error"))
            # Pins a late answer may have taken are dropped by this release,
            # which each worker handles after the lookup it follows.
            self._release_lookup(lookup_id)
            return None
        hit = min(int(reply["hit_tokens"]) for reply in replies)
        memory = min(int(reply.get("memory_tokens", 0)) for reply in replies)
        state.counted = (max(state.counted[0], end), max(state.counted[1], hit))
        state.answer = LookupAnswer(lookup_id=lookup_id, end=end, computed=computed, hit_tokens=hit,
                                    memory_tokens=min(memory, hit), asked_at=time.monotonic(),
                                    save_seq=self._save_seq)
        return state.answer

    def _load_async(self, state: RequestState, answer: LookupAnswer, usable: int) -> bool:
        if self._async_loads == "off" or state.async_failures or self._segments:
            # A blend load recomputes with the model in start_load_kv, inside the step it lands in.
            return False
        return self._async_loads == "always" or answer.memory_tokens < usable

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Record the load vLLM accepted, or drop the pins when it took none.

        vLLM calls this again for a request whose asynchronous load finished,
        with no external tokens: there is nothing left to do then.
        """
        state = self._state_for(request)
        self._attend(state)
        answer, state.answer = state.answer, None
        if num_external_tokens <= 0:
            if answer is not None:
                self._release(answer)
            return
        start = answer.computed if answer is not None else request.num_computed_tokens
        state.pending_load = PendingLoad(
            start=start, end=start + num_external_tokens,
            hit_tokens=answer.hit_tokens if answer is not None else start + num_external_tokens,
            lookup_id=answer.lookup_id if answer is not None else None, load_async=state.offered_async,
        )
        if state.offered_async:
            # Not scheduled this step: the blocks come from here, not from the scheduler output.
            state.block_ids = list(blocks.get_block_ids()[0])
            self._async_to_send.append(state)

    # -- each step's loads and saves -------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> FlowKVMetadata:
        """This step's loads (accepted in ``update_state_after_alloc``) and
        saves (chunks that this step's forward pass completes)."""
        meta = FlowKVMetadata(idle=not scheduler_output.total_num_scheduled_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        if not (self._attentive or scheduler_output.scheduled_new_reqs or cached.resumed_req_ids
                or self._async_to_send):
            return meta  # a decoding batch whose prompts flowkv holds
        steps: list[tuple[RequestState, int]] = []
        for new_req in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new_req.req_id)
            if state is None:
                continue
            self._attend(state)
            state.block_ids = list(new_req.block_ids[0])
            steps.append((state, new_req.num_computed_tokens))
        for index, req_id in enumerate(cached.req_ids):
            resumed = req_id in cached.resumed_req_ids
            if not resumed and req_id not in self._attentive:
                continue
            state = self._requests.get(req_id)
            if state is None:
                continue
            if resumed:
                self._attend(state)
            new_blocks = cached.new_block_ids[index]
            if resumed:
                state.block_ids = list(new_blocks[0]) if new_blocks is not None else []
            elif new_blocks is not None:
                state.block_ids.extend(new_blocks[0])
            steps.append((state, cached.num_computed_tokens[index]))

        for state, num_computed in steps:
            req_id = state.request.request_id
            rolled_back = num_computed < state.expected_computed
            if rolled_back:
                # Stores asked for past this point may have been cut short
                # (a failed load poisons the rest of its step); ask again.
                # The engine skips chunks it already holds.
                state.stored_end = min(state.stored_end, floor_to(num_computed, self._chunk_size))
            loads = state.pending_load is not None and not state.pending_load.load_async
            if loads:
                meta.loads.append(self._load_spec(state))
            computed_after_step = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            state.expected_computed = computed_after_step
            save = self._save_spec(state, computed_after_step)
            if save is not None:
                meta.saves.append(save)
            self._settle(state, quiet=not (rolled_back or loads or save is not None))
        # Loads vLLM waits for between steps: their requests are not scheduled now.
        for state in self._async_to_send:
            if state.pending_load is not None and state.request.request_id in self._requests:
                end = state.pending_load.end
                meta.loads.append(self._load_spec(state))
                state.expected_computed = end
        self._async_to_send = []
        return meta

    def _attend(self, state: RequestState) -> None:
        """``state``'s steps are looked at again (it is new, resumed, or was offered a load)."""
        self._attentive.add(state.request.request_id)
        state.quiet_steps = 0

    def _settle(self, state: RequestState, *, quiet: bool) -> None:
        """After a step of ``state``: it leaves the requests looked at once nothing can come
        for it but through `_attend`: no save left (its prompt stored, or it saves nothing),
        no load pending, and two quiet steps in a row (a rollback of its last save's step
        shows in the next step's output, or the one after with asynchronous scheduling)."""
        state.quiet_steps = state.quiet_steps + 1 if quiet else 0
        if state.quiet_steps < 2 or state.pending_load is not None:
            return
        request = state.request
        if not (state.skip_save or not self._saves) and (
                self._save_decode or state.stored_end < floor_to(request.num_prompt_tokens, self._chunk_size)):
            return
        self._attentive.discard(request.request_id)

    def _load_spec(self, state: RequestState) -> LoadSpec:
        load, state.pending_load = state.pending_load, None
        assert load is not None
        request = state.request
        size = self._chunk_size
        skip_prefix = floor_to(load.start, size)
        # To the end of the chunk holding the last loaded token (a stored partial chunk ends at the hit).
        end_of_tokens = min(ceil_to(load.end, size), max(load.hit_tokens, load.end))
        if self._segments:
            # The segment holding the last loaded token is keyed by all its tokens: send them.
            end_of_tokens = max(load.hit_tokens, load.end)
        if state.chain is not None:
            token_start = skip_prefix
            hashes: list[bytes] | None = state.chain.hashes(request, token_start, end_of_tokens)
        else:
            token_start, hashes = 0, None
        # Chunks flowkv serves are chunks it holds. Should the load come back
        # short, vLLM rolls the request back and the check in
        # build_connector_meta lowers this again.
        state.stored_end = max(state.stored_end, load.end if self._segments else floor_to(load.end, size))
        # The retrieve releases the lookup's pins.
        return LoadSpec(req_id=request.request_id, token_ids=request.all_token_ids[token_start:end_of_tokens],
                        token_start=token_start, block_ids=list(state.block_ids), start=load.start, end=load.end,
                        skip_prefix=skip_prefix, lookup_id=load.lookup_id, tags=state.tags,
                        chunk_hashes=hashes, load_async=load.load_async,
                        recompute_ratio=request_recompute_ratio(request) if self._segments else None)

    def _save_spec(self, state: RequestState, computed_after_step: int) -> SaveSpec | None:
        """The chunks this step completes that flowkv was not asked to store yet."""
        if state.skip_save or not self._saves:
            return None
        request = state.request
        known_tokens = request.num_tokens if self._save_decode else request.num_prompt_tokens
        store_end = min(computed_after_step, known_tokens)
        if not self._segments:
            store_end = floor_to(store_end, self._chunk_size)
        # (A segment pipeline stores every segment a separator closed by then; the segment stage
        # keeps the open one, the question, out.)
        start = state.stored_end
        if store_end <= start:
            return None
        state.stored_end = store_end
        # vLLM's block hashes, for flowkv's tier events in vLLM's KV events (when those are published).
        block_hashes = list(request.block_hashes) if self.publishes_kv_events else None
        if state.chain is None:
            # The engine skips whole chunks only (a segment pipeline's stored_end may lie inside one).
            return SaveSpec(req_id=request.request_id, token_ids=request.all_token_ids[:store_end], token_start=0,
                            block_ids=list(state.block_ids), skip_prefix=floor_to(start, self._chunk_size),
                            tags=state.tags,
                            block_hashes=block_hashes)
        hashes = state.chain.hashes(request, start, store_end)
        self._save_seq += 1
        for chunk_hash in hashes:
            self._saved_at[chunk_hash] = self._save_seq
            self._saved_at.move_to_end(chunk_hash)
        while len(self._saved_at) > _SAVED_REMEMBERED:
            self._saved_at.popitem(last=False)
        return SaveSpec(req_id=request.request_id, token_ids=request.all_token_ids[start:store_end],
                        token_start=start, block_ids=list(state.block_ids), skip_prefix=start, tags=state.tags,
                        chunk_hashes=hashes, block_hashes=block_hashes)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """A short asynchronous load makes that request's later loads synchronous; a short
        synchronous one is counted in ``num_cached_tokens`` as far as it got."""
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            state = self._requests.get(req_id)
            if state is not None:
                state.async_failures += 1
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            for state in self._requests.values():
                recount_short_load(state.request, state.block_ids, invalid, self._block_size)

    # -- the end ---------------------------------------------------------------------

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Drop the request's pins; saves are done by the time it finishes, so
        its blocks can be freed at once. A request to be decoded elsewhere
        gets the tokens stored for it in its response's ``kv_transfer_params``."""
        state = self._requests.pop(request.request_id, None)
        self._attentive.discard(request.request_id)
        if state is not None:
            self._drop_answer(state)
            if state.pending_load is not None:
                # A load vLLM accepted that never went to the worker (an asynchronous one is sent in the next
                # step's metadata, and a request ended before it is not): no retrieve will drop its pins.
                self._release_lookup(state.pending_load.lookup_id)
                state.pending_load = None
        if self._saves and wants_remote_decode(request.kv_transfer_params):
            stored = state.stored_end if state is not None and not state.skip_save else 0
            return False, prefill_answer(stored)
        return False, None

    def shutdown(self) -> None:
        if self._lookup_client is not None:
            self._lookup_client.close()
            self._lookup_client = None

    def _state_for(self, request: Request) -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            tags, skip_save = request_tags(request)
            chain = ChunkChain(request, self._chunk_size, self._hash_fn, self._vllm_hashes) if self._keyed else None
            state = RequestState(request=request, tags=tags, skip_save=skip_save, chain=chain)
            self._requests[request.request_id] = state
            self._attentive.add(request.request_id)
        return state

    def _drop_answer(self, state: RequestState) -> None:
        if state.answer is not None:
            self._release(state.answer)
        state.answer = None

    def _release(self, answer: LookupAnswer) -> None:
        self._release_lookup(answer.lookup_id)
        answer.lookup_id = None

    def _release_lookup(self, lookup_id: str | None) -> None:
        """Tell the workers to drop the pins of lookup ``lookup_id`` (none: nothing to drop)."""
        if lookup_id is not None and self._lookup_client is not None:
            self._lookup_client.tell({"op": "release", "lookup_id": lookup_id})
