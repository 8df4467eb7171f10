"""The README's `vllm serve` lines as a user copies them: each one's --kv-transfer-config is JSON that
vLLM's own KVTransferConfig accepts, names a connector class that imports, and a pipeline (with every
override it sets) that loads. The first one, the quick start, is the command `tests/test_vllm_serve.py`
starts for real (its fixtures build their --kv-transfer-config from it), so README drift fails."""

from __future__ import annotations

import importlib
import json

import pytest

from vllm_server import readme_serve_commands, readme_transfer_config

from flowkv.pipeline import load_pipeline

COMMANDS = [(line, argv) for line, argv in readme_serve_commands() if "--kv-transfer-config" in argv]


def test_the_readme_has_serve_lines_and_the_quick_start_is_the_first():
    assert len(COMMANDS) >= 3
    assert readme_transfer_config()["kv_connector_extra_config"] == {"pipeline": "local-cpu"}


@pytest.mark.parametrize(("line", "argv"), COMMANDS, ids=[f"README.md:{line}" for line, _ in COMMANDS])
def test_a_readme_serve_line_is_a_config_vllm_and_flowkv_accept(line, argv):
    from vllm.config import KVTransferConfig

    from flowkv.integration.vllm import ConnectorSettings

    assert argv[2] == "MODEL", f"README.md:{line}: vllm serve MODEL ..."
    raw = argv[argv.index("--kv-transfer-config") + 1]
    config = json.loads(raw)
    transfer = KVTransferConfig(**config)  # vLLM's own validation of the fields
    connector = getattr(importlib.import_module(transfer.kv_connector_module_path), transfer.kv_connector)
    assert connector.__name__ == "FlowKVConnector"
    assert transfer.kv_role in ("kv_both", "kv_producer", "kv_consumer")
    settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config, default_model="MODEL")
    pipeline = load_pipeline(settings.pipeline, overrides=settings.overrides)
    assert pipeline.name
