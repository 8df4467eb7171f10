"""What the vLLM connector refuses at start for a ``blend`` pipeline, and the per-request ratio.

The blend runs in the worker with the model vLLM loaded; where it cannot run
right, the connector stops vLLM at start in both processes, saying why:
another architecture (its modules are not the Llama-style ones the recompute
calls), tensor or pipeline parallel (the projections all-reduce across
ranks), vLLM's own prefix caching (it would hand the approximate blended
blocks to later requests as exact). The connector is built here from a real
``VllmConfig`` (vLLM's own ``EngineArgs``), without starting an engine.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

import vllm  # noqa: F401,E402 - a broken vLLM install fails these tests; it never skips them

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm_helpers import tiny_model_dir  # noqa: E402

from flowkv.integration.vllm import FlowKVConnector  # noqa: E402
from flowkv.integration.vllm.blend import refuse_unblendable  # noqa: E402
from flowkv.integration.vllm.settings import RECOMPUTE_RATIO_KEY, request_recompute_ratio  # noqa: E402
from flowkv.pipeline import PipelineError, load_pipeline  # noqa: E402

BLEND = {"pipeline": "blend", "blend.separator": [271, 198], "blend.recompute_ratio": 0.3}


def vllm_config(extra: dict, model: str | None = None, **engine_args):
    transfer = KVTransferConfig(kv_connector="FlowKVConnector", kv_connector_module_path="flowkv.integration.vllm",
                                kv_role="kv_both", kv_connector_extra_config=extra)
    engine_args.setdefault("enable_prefix_caching", False)
    return EngineArgs(model=model or str(tiny_model_dir()), kv_transfer_config=transfer,
                      **engine_args).create_engine_config()


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_prefix_caching_on_is_refused_in_both_processes(role) -> None:
    config = vllm_config({**BLEND, "pipeline": "blend-disk"}, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="vLLM's own prefix caching would hand them to later requests as "
                                         "exact. Start vLLM with --no-enable-prefix-caching") as err:
        FlowKVConnector(config, role, None)
    assert "blend-disk" in str(err.value)


def test_another_architecture_is_refused(tmp_path) -> None:
    model = tmp_path / "tiny-gemma-named"
    shutil.copytree(tiny_model_dir(), model)
    config_file = model / "config.json"
    hf_config = json.loads(config_file.read_text())
    hf_config["architectures"] = ["GemmaForCausalLM"]
    config_file.write_text(json.dumps(hf_config))
    config = vllm_config(BLEND, model=str(model))
    assert config.model_config.architectures == ["GemmaForCausalLM"]
    with pytest.raises(ValueError, match=r"which flowkv does for LlamaForCausalLM, Qwen2ForCausalLM, "
                                         r"MistralForCausalLM only; this model is GemmaForCausalLM"):
        FlowKVConnector(config, KVConnectorRole.SCHEDULER, None)


def test_tensor_parallel_is_refused() -> None:
    config = vllm_config(BLEND, tensor_parallel_size=2)
    assert config.parallel_config.tensor_parallel_size == 2
    with pytest.raises(ValueError, match=r"needs the whole model in one worker: tensor parallel size 2, "
                                         r"pipeline parallel size 1 \(the recompute would run on a shard whose "
                                         r"projections all-reduce across ranks\)"):
        FlowKVConnector(config, KVConnectorRole.SCHEDULER, None)


def test_a_blend_pipeline_on_a_supported_engine_starts_its_scheduler_side() -> None:
    connector = FlowKVConnector(vllm_config(BLEND), KVConnectorRole.SCHEDULER, None)
    try:
        assert connector.scheduler is not None
    finally:
        connector.shutdown()


def test_a_layerwise_blend_pipeline_is_refused() -> None:
    config = vllm_config(BLEND)
    pipeline = load_pipeline("blend", overrides={"blend.separator": [5], "layerwise.enabled": True})
    with pytest.raises(ValueError, match=r"set \[layerwise\] enabled = false"):
        refuse_unblendable(config, pipeline)
    refuse_unblendable(config, load_pipeline("local-cpu"))


def test_a_blend_pipeline_off_vllms_cpu_backend_is_refused() -> None:
    pipeline = load_pipeline("blend", overrides={"blend.separator": [5]})
    with pytest.raises(ValueError, match=r"on vLLM's CPU backend only \(it reads and writes single tokens "
                                         r"through the CPU cache-write op\)"):
        refuse_unblendable(vllm_config(BLEND), pipeline, cpu=False)
    refuse_unblendable(vllm_config(BLEND), pipeline, cpu=True)


def test_a_blend_pipeline_without_a_separator_stops_vllm_at_load_with_its_place() -> None:
    with pytest.raises(PipelineError, match=r"blend\.toml:\d+:\d+: \[blend\]: missing required key 'separator'"):
        FlowKVConnector(vllm_config({"pipeline": "blend"}), KVConnectorRole.SCHEDULER, None)


@pytest.mark.parametrize(("given", "ratio"), [(None, None), (0.0, 0.0), (1, 1.0), ("0.25", 0.25), (1.5, None),
                                              (-0.1, None), ("much", None), ([1], None)])
def test_a_request_sets_its_own_recompute_ratio_or_keeps_the_pipelines(given, ratio) -> None:
    params = {} if given is None else {RECOMPUTE_RATIO_KEY: given}
    assert request_recompute_ratio(SimpleNamespace(kv_transfer_params=params)) == ratio


def test_without_flowkvs_model_plugin_the_worker_refuses_to_blend(monkeypatch) -> None:
    """``VLLM_PLUGINS`` leaving out ``flowkv-models``: no model was recorded in the worker."""
    from flowkv.integration.vllm import models
    from flowkv.integration.vllm.blend import Blender

    monkeypatch.setattr(models, "_loaded", None)
    pipeline = load_pipeline("blend", overrides={"blend.separator": [5]})
    with pytest.raises(RuntimeError, match=r"'flowkv-models' was not loaded: is VLLM_PLUGINS set without it\?"):
        Blender(vllm_config(BLEND), pipeline.blend, {}, num_kv_heads=2, head_size=64, block_size=128)
