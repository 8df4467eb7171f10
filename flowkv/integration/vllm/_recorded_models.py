"""vLLM's Llama, Qwen2 and Mistral model classes, each recording itself once built (see ``models``).

Each keeps its stock class's name: vLLM reads a model's architecture from the
class name (``_ModelInfo.architecture``), and it must not differ. Only
imported where vLLM builds or inspects a model (the registration names these
classes lazily). Their ``__init__`` keeps the stock keyword-only signature:
vLLM reads it to decide how to construct a model.
"""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.model_executor.models import llama, mistral, qwen2

from flowkv.integration.vllm.models import record

__all__ = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"]


class LlamaForCausalLM(llama.LlamaForCausalLM):
    """vLLM's ``LlamaForCausalLM``, recorded for flowkv's blend; nothing else differs."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        record(self)


class Qwen2ForCausalLM(qwen2.Qwen2ForCausalLM):
    """vLLM's ``Qwen2ForCausalLM``, recorded for flowkv's blend; nothing else differs."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        record(self)


class MistralForCausalLM(mistral.MistralForCausalLM):
    """vLLM's ``MistralForCausalLM``, recorded for flowkv's blend; nothing else differs."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        record(self)
