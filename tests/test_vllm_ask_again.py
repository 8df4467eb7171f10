"""vLLM's scheduler keeps a request waiting while its connector answers ``None``, and asks again each step.

Disaggregated prefill relies on it (``flowkv/integration/vllm/disagg.py``): a
decode instance's connector answers ``get_num_new_matched_tokens`` with
``(None, False)`` ("ask again later") while the shared tier holds less of the
prompt than its prefill instance committed. This drives vLLM 0.32's own
``Scheduler`` in this process (no engine, no model run) with a connector
that answers ``None`` a few times, so a vLLM that stops honouring it fails
here before it fails a deployment; ``test_vllm_disagg.py`` shows the same
through real ``vllm serve`` processes.
"""

from __future__ import annotations

from typing import Any

import torch
import vllm  # noqa: F401 - a broken vLLM install fails these tests; it never skips them

from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from vllm_helpers import BLOCK_SIZE, random_tokens, tiny_model_dir

NOT_YET = 3  # answers of None before the KV "is there"
PROMPT = random_tokens(77, 5 * BLOCK_SIZE + 9)


class AskAgainConnector(KVConnectorBase_V1):
    """Answers ``(None, False)`` ``NOT_YET`` times per request, then the prompt's whole blocks; loads nothing."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.asked: dict[str, int] = {}
        self.accepted: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self.asked[request.request_id] = self.asked.get(request.request_id, 0) + 1
        if self.asked[request.request_id] <= NOT_YET:
            return None, False
        return (request.num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        self.accepted[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    # The worker side never runs here.
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...
    def wait_for_layer_load(self, layer_name: str) -> None: ...
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None: ...
    def wait_for_save(self) -> None: ...


def scheduler() -> Scheduler:
    config = VllmConfig(
        model_config=ModelConfig(model=str(tiny_model_dir()), dtype="float32", seed=0, max_model_len=4096),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=8, max_model_len=4096,
                                         is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(kv_connector="AskAgainConnector", kv_role="kv_consumer",
                                            kv_connector_module_path=__name__),
        device_config=DeviceConfig("cpu"))
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype=torch.float32)
    config.cache_config.num_gpu_blocks = 64  # what vLLM sets once it sized the pool
    kv_cache = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return Scheduler(config, kv_cache, StructuredOutputManager(config), block_size=BLOCK_SIZE)


def test_a_request_answered_none_waits_unscheduled_and_is_asked_again_each_step():
    sched = scheduler()
    connector = sched.connector
    assert isinstance(connector, AskAgainConnector)
    request = Request("r", list(PROMPT), SamplingParams(max_tokens=4), None)
    sched.add_request(request)
    for step in range(1, NOT_YET + 1):
        out = sched.schedule()
        # Not scheduled, no blocks, still waiting: asked once per step.
        assert out.scheduled_new_reqs == [] and out.num_scheduled_tokens == {}, step
        assert request.status == RequestStatus.WAITING and connector.asked["r"] == step
        assert "r" not in connector.accepted
        assert not any(sched.kv_cache_manager.get_block_ids("r"))
    out = sched.schedule()
    # The answer came: the request runs from the tokens the connector offered.
    loaded = (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert connector.accepted["r"] == loaded
    [new] = out.scheduled_new_reqs
    assert new.req_id == "r" and new.num_computed_tokens == loaded
    assert out.num_scheduled_tokens == {"r": len(PROMPT) - loaded}
