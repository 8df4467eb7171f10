"""flowkv: a KV-cache layer for LLM inference.

Store and retrieve are TOML-declared pipelines of generator stages; every
stage run is an OpenTelemetry span; the vLLM connector lives in
``flowkv.integration.vllm``.
"""

from flowkv.calls import KVTransfer, RetrieveResult, StoreResult
from flowkv.items import Chunk, Request, RunContext, Services
from flowkv.pipeline import Diagnostic, Pipeline, PipelineError, load_pipeline, loads_pipeline
from flowkv.registry import Facet, Role, stage, tier
from flowkv.runner import Runner, StageError

__version__ = "0.1.0"

__all__ = [
    "CacheEngine",
    "Chunk",
    "Diagnostic",
    "Facet",
    "KVTransfer",
    "Pipeline",
    "PipelineError",
    "Request",
    "RetrieveResult",
    "Role",
    "RunContext",
    "Runner",
    "Services",
    "StageError",
    "StoreResult",
    "load_pipeline",
    "loads_pipeline",
    "stage",
    "tier",
]


def __getattr__(name: str):
    # The engine pulls in torch-heavy parts; import it only when asked for.
    if name == "CacheEngine":
        from flowkv.engine import CacheEngine

        return CacheEngine
    raise AttributeError(f"module 'flowkv' has no attribute {name!r}")
