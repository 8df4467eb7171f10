"""flowkv's model plugin (vLLM's Llama / Qwen2 / Mistral, recorded for the blend) and the vLLM facts it rests on.

vLLM hands a KV connector no model; CacheBlend's recompute needs the one vLLM
loaded. flowkv's ``vllm.general_plugins`` entry (``flowkv-models``)
registers subclasses under the stock architecture names that only record the
model once built. These tests pin what that relies on in the installed vLLM:
general plugins run in the worker process before the worker, and so the
model, is built; ``ModelRegistry`` takes a lazy ``"module:class"`` over a
stock name; the subclasses change nothing but construction. That the outputs
equal the stock classes' is shown with real engines in ``test_vllm_blend.py``.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from importlib.metadata import entry_points

import pytest

import vllm  # noqa: F401,E402 - a broken vLLM install fails these tests; it never skips them

from flowkv.integration.vllm import models  # noqa: E402


def test_the_plugin_is_a_vllm_general_plugins_entry_point_of_flowkv() -> None:
    from vllm.plugins import DEFAULT_PLUGINS_GROUP

    assert DEFAULT_PLUGINS_GROUP == "vllm.general_plugins"
    found = {entry.name: entry for entry in entry_points(group=DEFAULT_PLUGINS_GROUP)}
    assert "flowkv-models" in found, sorted(found)
    assert found["flowkv-models"].load() is models.register_models


def _calls_in_order(function) -> list[str]:
    """The names of the functions ``function``'s body calls, in source order."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
    calls.sort(key=lambda node: (node.lineno, node.col_offset))
    names = []
    for node in calls:
        func = node.func
        names.append(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "?"))
    return names


def test_vllm_loads_general_plugins_in_the_worker_before_it_builds_the_worker_and_model() -> None:
    """``WorkerWrapperBase.init_worker`` (the worker process) loads general plugins, then
    resolves and builds the worker class; the model is built later, in ``load_model``."""
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    calls = _calls_in_order(WorkerWrapperBase.init_worker)
    assert "load_general_plugins" in calls, calls
    assert "resolve_obj_by_qualname" in calls, calls
    assert calls.index("load_general_plugins") < calls.index("resolve_obj_by_qualname"), calls
    # The engine-core process (the scheduler's connector) loads them too.
    from vllm.v1.engine.core import EngineCore

    assert "load_general_plugins" in _calls_in_order(EngineCore.__init__)


def test_the_registry_resolves_the_stock_names_to_the_recorded_subclasses() -> None:
    from vllm import ModelRegistry
    from vllm.model_executor.models.registry import _ModelInfo
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.mistral import MistralForCausalLM
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    models.register_models()
    models.register_models()  # vLLM may load a plugin more than once per process
    stock = {"LlamaForCausalLM": LlamaForCausalLM, "Qwen2ForCausalLM": Qwen2ForCausalLM,
             "MistralForCausalLM": MistralForCausalLM}
    assert set(models.BLENDABLE_ARCHITECTURES) == set(stock)
    for architecture, base in stock.items():
        cls = ModelRegistry._try_load_model_cls(architecture)
        assert cls is not base and cls.__mro__[1] is base, (architecture, cls.__mro__)
        # Nothing but construction differs from the stock class.
        defined = {name for name, value in vars(cls).items()
                   if callable(value) or isinstance(value, (staticmethod, classmethod, property))}
        # (typing.Protocol gives every subclass of a protocol its own __subclasshook__)
        assert defined - {"__subclasshook__"} == {"__init__"}, sorted(defined)
        # vLLM reads a model's interfaces (PP, LoRA, quantization, ...) from its class: as the stock one's.
        assert _ModelInfo.from_model_cls(cls) == _ModelInfo.from_model_cls(base)


def test_a_recorded_class_records_the_model_it_built() -> None:
    from flowkv.integration.vllm._recorded_models import LlamaForCausalLM

    class Built:
        pass

    model = Built()
    models.record(model)
    assert models.loaded_model() is model
    assert LlamaForCausalLM.__init__.__code__.co_names.count("record") == 1


def test_the_recorded_classes_take_the_arguments_vllm_builds_new_style_models_with() -> None:
    """vLLM builds a model as ``cls(vllm_config=, prefix=)`` only when its ``__init__`` names both;
    otherwise it guesses old-style arguments (and a recorded class would fail to start)."""
    from vllm.model_executor.model_loader.utils import initialize_model

    source = inspect.getsource(initialize_model)
    assert '"vllm_config" in all_params and "prefix" in all_params' in source
    assert "model_class(vllm_config=vllm_config, prefix=prefix)" in source
    from flowkv.integration.vllm import _recorded_models

    for name in models.BLENDABLE_ARCHITECTURES:
        parameters = inspect.signature(getattr(_recorded_models, name).__init__).parameters
        assert {"vllm_config", "prefix"} <= set(parameters), (name, list(parameters))
        assert parameters["vllm_config"].kind is inspect.Parameter.KEYWORD_ONLY


def _self_calls(function) -> list[str]:
    """The ``self.X(...)`` calls of ``function``'s body, in source order."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"]
    return [node.func.attr for node in sorted(calls, key=lambda node: (node.lineno, node.col_offset))]


# What the blend's recompute replays of each layer (flowkv.integration.vllm.blend.Blender._recompute),
# and the extra steps of variants it refuses at start (blend._refuse_variant).
ATTENTION_STEPS = ["qkv_proj", "rotary_emb", "attn", "o_proj"]
LAYER_STEPS = ["input_layernorm", "input_layernorm", "self_attn", "post_attention_layernorm", "mlp"]
REFUSED_STEPS = {"q_norm", "k_norm", "_get_llama_4_attn_scale", "ada_rms_norm_t_cond"}


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_the_layers_forward_is_the_sequence_the_blend_replays(family) -> None:
    import importlib

    module = importlib.import_module(f"vllm.model_executor.models.{family}")
    prefix = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[family]
    attention, layer = getattr(module, f"{prefix}Attention"), getattr(module, f"{prefix}DecoderLayer")
    for cls, steps in ((attention, ATTENTION_STEPS), (layer, LAYER_STEPS)):
        calls = _self_calls(cls.forward)
        assert [call for call in calls if call not in REFUSED_STEPS] == steps, (cls.__qualname__, calls)
    # The attention's projections split q, k, v by these sizes; the model embeds with embed_tokens.
    assert "qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)" in inspect.getsource(attention.forward)
    model = getattr(module, f"{prefix}Model", None) or module.LlamaModel
    assert "self.embed_tokens(" in inspect.getsource(model.embed_input_ids)


def test_the_attention_facts_the_blend_reads() -> None:
    """The blend reads, never calls, vLLM's ``attn`` module: its ``layer_name`` (the KV cache's key),
    ``sliding_window`` (refused), and its backend's ``impl.scale`` (the softmax scale it attends at)."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    init = inspect.getsource(Attention.__init__)
    for fact in ("self.layer_name = prefix", "self.sliding_window = sliding_window", "self.impl = impl_cls("):
        assert fact in init, fact
    assert "self.scale = float(scale)" in inspect.getsource(CPUAttentionBackendImpl.__init__)
