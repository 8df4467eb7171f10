"""The model vLLM loaded, for the blend: thin subclasses of vLLM's model classes that record it.

vLLM hands a KV connector its KV cache but not its model, and CacheBlend's
selective recompute must run the reused tokens through the model's own
modules with the weights vLLM loaded. vLLM's supported hook for code that
must run before a model is built is a ``vllm.general_plugins`` entry point:
vLLM calls it in every process, and in a worker process from
``WorkerWrapperBase.init_worker`` before the worker (and so the model) is
constructed. flowkv's entry point (`register_models`) registers, under the
stock architecture names, subclasses of ``LlamaForCausalLM``,
``Qwen2ForCausalLM`` and ``MistralForCausalLM`` whose only change is that
construction records the model here (`loaded_model`). They compute exactly
what the stock classes compute (``tests/test_blend_models.py`` compares).

The registration is lazy (``"module:class"``): the vLLM model modules are
imported only in the process that builds the model.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["BLENDABLE_ARCHITECTURES", "loaded_model", "register_models"]

#: architecture name -> the flowkv subclass that records the model (all keep vLLM's Llama-style layer modules)
BLENDABLE_ARCHITECTURES = {
    "LlamaForCausalLM": "flowkv.integration.vllm._recorded_models:LlamaForCausalLM",
    "Qwen2ForCausalLM": "flowkv.integration.vllm._recorded_models:Qwen2ForCausalLM",
    "MistralForCausalLM": "flowkv.integration.vllm._recorded_models:MistralForCausalLM",
}

# The latest model built in this process (a weak reference: the model's life is vLLM's).
_loaded: weakref.ReferenceType[Any] | None = None


def record(model: Any) -> None:
    """Called by the recorded classes once vLLM built them."""
    global _loaded
    _loaded = weakref.ref(model)


def loaded_model() -> Any | None:
    """The model vLLM built in this process through one of flowkv's recorded classes, if any."""
    return _loaded() if _loaded is not None else None


def register_models() -> None:
    """Register the recorded classes under the stock architecture names (idempotent)."""
    from vllm import ModelRegistry

    for architecture, qualname in BLENDABLE_ARCHITECTURES.items():
        ModelRegistry.register_model(architecture, qualname)
