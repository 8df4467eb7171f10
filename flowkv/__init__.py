"""flowkv: a KV-cache layer for LLM inference.

Store and retrieve are TOML-declared pipelines of generator stages; every
stage run is an OpenTelemetry span; the vLLM connector lives in
``flowkv.integration.vllm``.
"""

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


# Where each public name lives: imported on first use, so that a process that needs none of them (the
# fleet's controller and router, see flowkv.cli.FLEET_COMMANDS) does not pay for torch's import (~1.5 s).
_HOMES = {
    "CacheEngine": "flowkv.engine",
    "Chunk": "flowkv.items", "Request": "flowkv.items", "RunContext": "flowkv.items", "Services": "flowkv.items",
    "Diagnostic": "flowkv.pipeline", "Pipeline": "flowkv.pipeline", "PipelineError": "flowkv.pipeline",
    "load_pipeline": "flowkv.pipeline", "loads_pipeline": "flowkv.pipeline",
    "Facet": "flowkv.registry", "Role": "flowkv.registry", "stage": "flowkv.registry", "tier": "flowkv.registry",
    "KVTransfer": "flowkv.calls", "RetrieveResult": "flowkv.calls", "StoreResult": "flowkv.calls",
    "Runner": "flowkv.runner", "StageError": "flowkv.runner",
}


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'flowkv' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
