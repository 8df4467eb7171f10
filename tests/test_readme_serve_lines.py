"""The `vllm serve` lines of README.md and of the examples' READMEs as a user copies them: each one's --kv-transfer-config is JSON that
vLLM's own KVTransferConfig accepts, names a connector class that imports, and a pipeline (with every
override it sets) that loads. The first one, the quick start, is the command `tests/test_vllm_serve.py`
starts for real (its fixtures build their --kv-transfer-config from it), so README drift fails."""

from __future__ import annotations

import importlib
import json

import pytest

from vllm_server import README, readme_serve_commands, readme_transfer_config

from flowkv.pipeline import load_pipeline

DOCS = [README, *sorted(README.parent.glob("examples/**/README.md"))]
COMMANDS = [(f"{doc.relative_to(README.parent)}:{line}", argv) for doc in DOCS
            for line, argv in readme_serve_commands(doc) if "--kv-transfer-config" in argv]


def test_the_readme_has_serve_lines_and_the_quick_start_is_the_first():
    assert len([where for where, _ in COMMANDS if where.startswith("README.md:")]) >= 3
    assert any(where.startswith("examples/systemd/") for where, _ in COMMANDS)
    assert readme_transfer_config()["kv_connector_extra_config"] == {"pipeline": "local-cpu"}


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[where for where, _ in COMMANDS])
def test_a_readme_serve_line_is_a_config_vllm_and_flowkv_accept(where, argv):
    from vllm.config import KVTransferConfig

    from flowkv.integration.vllm import ConnectorSettings

    assert argv[2] == "MODEL", f"{where}: vllm serve MODEL ..."
    raw = argv[argv.index("--kv-transfer-config") + 1]
    config = json.loads(raw)
    transfer = KVTransferConfig(**config)  # vLLM's own validation of the fields
    connector = getattr(importlib.import_module(transfer.kv_connector_module_path), transfer.kv_connector)
    assert connector.__name__ == "FlowKVConnector"
    assert transfer.kv_role in ("kv_both", "kv_producer", "kv_consumer")
    settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config, default_model="MODEL")
    pipeline = load_pipeline(settings.pipeline, overrides=settings.overrides)
    assert pipeline.name
