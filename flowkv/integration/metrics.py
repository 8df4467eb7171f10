"""Moved to ``flowkv.integration.vllm.metrics``; this alias keeps the old import path working."""

from flowkv.integration.vllm.metrics import FlowKVPromMetrics, FlowKVStats, snapshot

__all__ = ["FlowKVPromMetrics", "FlowKVStats", "snapshot"]
