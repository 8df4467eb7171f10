"""The connector in vLLM's scheduler (engine-core) process: lookups, and each step's loads and saves.

flowkv's engine lives in the workers, so a lookup asks every worker over IPC
and waits at most ``[vllm] lookup_timeout_ms`` (0 hits past it). The
scheduler keeps one ``RequestState`` per request it has seen: the pins its
latest lookup holds, the load vLLM accepted, and how far the request's
chunks were asked to be stored, so each step's ``FlowKVMetadata`` carries
only new work.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from flowkv.integration._ipc import LookupClient
from flowkv.integration.vllm.kv_events import publishes_kv_events
from flowkv.integration.vllm.metadata import FlowKVMetadata, LoadSpec, SaveSpec, ceil_to, floor_to
from flowkv.integration.vllm.settings import ConnectorSettings, Instance, request_tags

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from flowkv.pipeline_model import Pipeline

logger = logging.getLogger("flowkv.integration")

__all__ = ["ConnectorScheduler", "RequestState"]


@dataclass
class RequestState:
    """What the scheduler connector knows of one request."""

    # vLLM's live object: all_token_ids grows as it decodes; a slice of it is a new list.
    request: Request
    tags: dict[str, str]
    skip_save: bool
    block_ids: list[int] = field(default_factory=list)
    # Pins held in the workers for this request's latest lookup.
    lookup_id: str | None = None
    # Tokens the latest lookup found (chunk-aligned) and the vLLM-computed
    # tokens it was asked beyond.
    hit_tokens: int = 0
    lookup_base: int = 0
    # A load vLLM accepted and the next step must carry out.
    pending_load: tuple[int, int] | None = None
    # Tokens (chunk-aligned) this request asked flowkv to store.
    stored_end: int = 0
    # Tokens vLLM will have computed after the last scheduled step; fewer at
    # the next step means vLLM rolled the request back (failed load, preemption).
    expected_computed: int = 0


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
        self._loads = kv_transfer_config.is_kv_consumer
        self._saves = kv_transfer_config.is_kv_producer
        self._requests: dict[str, RequestState] = {}
        self._lookup_seq = itertools.count()
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

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past ``num_computed_tokens`` flowkv can load: whole vLLM
        blocks, never the request's last token, 0 when the workers do not
        answer in time."""
        state = self._state_for(request)
        self._release(state)
        state.hit_tokens = 0
        state.lookup_base = num_computed_tokens
        num_tokens = request.num_tokens
        # The last token is always computed: its logits are the next token's.
        ceiling = floor_to(num_tokens - 1, self._block_size)
        if not self._loads or ceiling <= num_computed_tokens or request.prompt_token_ids is None:
            return 0, False
        # Only whole chunks can hit unless the pipeline stores partial ones.
        lookup_end = num_tokens if self._partial_chunks else floor_to(num_tokens, self._chunk_size)
        if lookup_end <= num_computed_tokens:
            return 0, False
        assert self._lookup_client is not None
        token_ids = request.all_token_ids[:lookup_end]
        lookup_id = f"{request.request_id}#{next(self._lookup_seq)}"
        replies = self._lookup_client.ask(
            {"op": "lookup", "lookup_id": lookup_id, "tags": state.tags}, np.asarray(token_ids, dtype=np.int64)
        )
        if replies is None or not all(reply.get("ok") for reply in replies):
            for reply in replies or ():
                if not reply.get("ok"):
                    logger.warning("flowkv: lookup failed on a worker: %s", reply.get("error"))
            # Pins a late answer may have taken are dropped by this release,
            # which each worker handles after the lookup it follows.
            self._lookup_client.tell({"op": "release", "lookup_id": lookup_id})
            return 0, False
        state.lookup_id = lookup_id
        state.hit_tokens = min(int(reply["hit_tokens"]) for reply in replies)
        # Whole vLLM blocks only: a partial block would be written by the
        # load and again by the forward pass, or shared with another request.
        usable = floor_to(min(state.hit_tokens, num_tokens - 1), self._block_size)
        if usable <= num_computed_tokens:
            self._release(state)
            return 0, False
        return usable - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Record the load vLLM accepted, or drop the pins when it took none."""
        state = self._state_for(request)
        if num_external_tokens > 0:
            start = state.lookup_base
            state.pending_load = (start, start + num_external_tokens)
        else:
            self._release(state)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> FlowKVMetadata:
        """This step's loads (accepted in ``update_state_after_alloc``) and
        saves (chunks that this step's forward pass completes)."""
        meta = FlowKVMetadata()
        steps: list[tuple[RequestState, int]] = []
        for new_req in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new_req.req_id)
            if state is None:
                continue
            state.block_ids = list(new_req.block_ids[0])
            steps.append((state, new_req.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[index]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_blocks[0]) if new_blocks is not None else []
            elif new_blocks is not None:
                state.block_ids.extend(new_blocks[0])
            steps.append((state, cached.num_computed_tokens[index]))

        for state, num_computed in steps:
            req_id = state.request.request_id
            if num_computed < state.expected_computed:
                # Stores asked for past this point may have been cut short
                # (a failed load poisons the rest of its step); ask again.
                # The engine skips chunks it already holds.
                state.stored_end = min(state.stored_end, floor_to(num_computed, self._chunk_size))
            if state.pending_load is not None:
                start, end = state.pending_load
                state.pending_load = None
                skip_prefix = floor_to(start, self._chunk_size)
                meta.loads.append(
                    LoadSpec(
                        req_id=req_id,
                        # To the end of the chunk holding the last loaded token
                        # (a stored partial chunk ends at the hit).
                        token_ids=state.request.all_token_ids[
                            :min(ceil_to(end, self._chunk_size), max(state.hit_tokens, end))
                        ],
                        block_ids=list(state.block_ids),
                        start=start,
                        end=end,
                        skip_prefix=skip_prefix,
                        lookup_id=state.lookup_id,
                        tags=state.tags,
                    )
                )
                # The retrieve releases the lookup's pins.
                state.lookup_id = None
                # Chunks flowkv serves are chunks it holds. Should the load
                # come back short, vLLM rolls the request back and the check
                # above lowers this again.
                state.stored_end = max(state.stored_end, floor_to(end, self._chunk_size))
            computed_after_step = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            state.expected_computed = computed_after_step
            if state.skip_save or not self._saves:
                continue
            known_tokens = state.request.num_tokens if self._save_decode else state.request.num_prompt_tokens
            store_end = floor_to(min(computed_after_step, known_tokens), self._chunk_size)
            if store_end > state.stored_end:
                meta.saves.append(
                    SaveSpec(
                        req_id=req_id,
                        token_ids=state.request.all_token_ids[:store_end],
                        block_ids=list(state.block_ids),
                        skip_prefix=state.stored_end,
                        tags=state.tags,
                        block_hashes=list(state.request.block_hashes) if self.publishes_kv_events else None,
                    )
                )
                state.stored_end = store_end
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Drop the request's pins; saves are done by the time it finishes, so
        its blocks can be freed at once."""
        state = self._requests.pop(request.request_id, None)
        if state is not None:
            self._release(state)
        return False, None

    def shutdown(self) -> None:
        if self._lookup_client is not None:
            self._lookup_client.close()
            self._lookup_client = None

    def _state_for(self, request: Request) -> RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            tags, skip_save = request_tags(request)
            state = RequestState(request=request, tags=tags, skip_save=skip_save)
            self._requests[request.request_id] = state
        return state

    def _release(self, state: RequestState) -> None:
        if state.lookup_id is not None and self._lookup_client is not None:
            self._lookup_client.tell({"op": "release", "lookup_id": state.lookup_id})
        state.lookup_id = None
