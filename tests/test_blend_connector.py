"""The vLLM connector refuses ``blend`` pipelines at start until blending runs in the worker.

Served through the prefix path, a document found at another place in the
prompt would be loaded as if it were the exact prefix: KV computed at other
positions, silently. The connector is built here from a real ``VllmConfig``
(vLLM's own ``EngineArgs``), without starting an engine.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm_helpers import tiny_model_dir  # noqa: E402

from flowkv.integration.vllm import FlowKVConnector  # noqa: E402
from flowkv.integration.vllm.settings import refuse_unsupported_pipeline  # noqa: E402
from flowkv.pipeline import PipelineError, load_pipeline  # noqa: E402


def vllm_config(extra: dict):
    transfer = KVTransferConfig(kv_connector="FlowKVConnector", kv_connector_module_path="flowkv.integration.vllm",
                                kv_role="kv_both", kv_connector_extra_config=extra)
    return EngineArgs(model=str(tiny_model_dir()), kv_transfer_config=transfer).create_engine_config()


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_the_connector_refuses_a_blend_pipeline_at_start_in_both_processes(role) -> None:
    config = vllm_config({"pipeline": "blend-disk", "blend.separator": [271, 198], "blend.recompute_ratio": 0.3})
    with pytest.raises(ValueError, match="blending is not yet supported in the vLLM connector") as err:
        FlowKVConnector(config, role, None)
    assert "blend-disk" in str(err.value) and "local-cpu" in str(err.value)


def test_a_blend_pipeline_without_a_separator_stops_vllm_at_load_with_its_place() -> None:
    with pytest.raises(PipelineError, match=r"blend\.toml:\d+:\d+: \[blend\]: missing required key 'separator'"):
        FlowKVConnector(vllm_config({"pipeline": "blend"}), KVConnectorRole.SCHEDULER, None)


def test_only_pipelines_with_a_blend_table_are_refused() -> None:
    refuse_unsupported_pipeline(load_pipeline("local-cpu"))
    with pytest.raises(ValueError, match="not yet supported"):
        refuse_unsupported_pipeline(load_pipeline("blend", overrides={"blend.separator": [5]}))
