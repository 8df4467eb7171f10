"""flowkv as a vLLM KV connector (vLLM v1 connector API, vLLM 0.32).

vLLM loads ``FlowKVConnector`` from this package::

    KVTransferConfig(kv_connector="FlowKVConnector",
                     kv_connector_module_path="flowkv.integration.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"pipeline": "local-cpu"})

The settings (``kv_connector_extra_config`` keys, per-request
``kv_transfer_params``) are in the README, "Using it with vLLM"; how the
connector sits in vLLM's processes and hooks is in ``docs/internals.md``.

- ``connector``: ``FlowKVConnector``, the façade: checks the pipeline,
  asserts its role and hands each hook to its side;
- ``scheduler``: the engine-core side: lookups over IPC, each step's
  loads and saves;
- ``worker``: the worker side: the engine, loads into and saves out of
  vLLM's pages, whole or layer by layer;
- ``metadata``: what the scheduler sends the workers each step;
- ``settings``: the extra config, the instance, per-request tags;
- ``tracing``: a ``flowkv.step`` span per engine step;
- ``metrics``: connector stats and ``vllm:flowkv_*`` Prometheus metrics;
- ``query``: what a worker answers on its socket, and asking a running
  instance's workers (stats, trace flush).
"""

from flowkv.integration.vllm.connector import FlowKVConnector
from flowkv.integration.vllm.metadata import FlowKVMetadata, LoadSpec, SaveSpec
from flowkv.integration.vllm.query import flush_worker_traces, worker_socket, worker_stats
from flowkv.integration.vllm.settings import ConnectorSettings, request_tags

__all__ = [
    "ConnectorSettings",
    "FlowKVConnector",
    "FlowKVMetadata",
    "LoadSpec",
    "SaveSpec",
    "flush_worker_traces",
    "request_tags",
    "worker_socket",
    "worker_stats",
]
