"""vLLM's cached-token count when a chunk on disk is corrupt, through a real `vllm serve` and HTTP.

A user of the OpenAI API reads ``usage.prompt_tokens_details.cached_tokens``;
vLLM sets it from the connector's answer to its lookup. A document stored by
flowkv (``cpu-disk``, a memory tier of 8 chunks) is pushed out of memory by
two others, and one of its chunk files on disk is then corrupted. Asked again,
flowkv answers the 7 chunks the disk index holds, as an asynchronous load;
reading them finds chunk 3 corrupt, so the load is reported failed and vLLM
looks the request up again: the count it reports is the 3 chunks that loaded.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import vllm  # noqa: F401,E402 - a broken vLLM install fails these tests; it never skips them

from vllm_helpers import KV_BYTES_PER_TOKEN, random_tokens  # noqa: E402
from vllm_server import start_server  # noqa: E402

from flowkv.integration._ipc import query_worker  # noqa: E402

pytestmark = pytest.mark.vllm

CHUNK = 256
DOC = 2000  # 7 whole chunks


def disk_written(server, timeout_s: float = 120.0) -> None:
    """Wait until the worker's disk tier wrote everything it was given."""
    [socket] = list(server.ipc_dir.glob("*.sock"))
    deadline = time.monotonic() + timeout_s
    while True:
        disk = query_worker(socket, "stats")["stats"]["tiers"]["disk"]
        if disk["write_queue"] == 0 and disk["write_done"] + disk["write_dropped"] >= disk["write_queued"]:
            return
        assert time.monotonic() < deadline, f"disk writes did not finish: {disk}"
        time.sleep(0.1)


def chunk_files(disk: Path) -> list[Path]:
    """The disk tier's files, oldest first (written behind in the order the chunks were stored)."""
    return sorted((p for p in disk.rglob("*") if p.is_file()), key=lambda p: p.stat().st_mtime_ns)


def test_cached_tokens_count_what_loaded_when_a_chunk_on_disk_is_corrupt(tmp_path):
    disk = tmp_path / "disk"
    server = start_server(tmp_path / "server", kv_extra={
        "pipeline": "cpu-disk", "chunk_size": CHUNK, "tiers.disk.path": str(disk),
        # 8 chunks of the tiny model: two more documents push the first out.
        "tiers.memory.capacity": 8 * CHUNK * KV_BYTES_PER_TOKEN,
    })
    try:
        doc = random_tokens(81, DOC)
        server.complete(doc + [5, 6, 7], max_tokens=2)
        disk_written(server)
        files = chunk_files(disk)
        assert len(files) == DOC // CHUNK
        for seed in (82, 83):
            server.complete(random_tokens(seed, DOC), max_tokens=1)
        disk_written(server)
        # Chunk 3 of the document: its payload no longer matches its checksum.
        data = bytearray(files[3].read_bytes())
        data[len(data) // 2:len(data) // 2 + 64] = bytes(64)
        files[3].write_bytes(bytes(data))

        # The reference: the same prompt computed by the model alone (a tag of its own keys it apart, so
        # nothing is found; nothing is stored).
        alone = server.complete(doc + [8, 9], max_tokens=8,
                                kv_transfer_params={"flowkv.skip_save": True, "flowkv.tag.test": "reference"})
        assert (alone["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0

        [socket] = list(server.ipc_dir.glob("*.sock"))
        retrieved = server.metric("vllm:flowkv_retrieved_tokens_total")
        reply = server.complete(doc + [8, 9], max_tokens=8)
        # What vLLM reports as cached is what flowkv loaded, and flowkv counted it once.
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * CHUNK
        assert server.metric("vllm:flowkv_retrieved_tokens_total") - retrieved == 3 * CHUNK
        # The three good chunks loaded and the rest recomputed: the answer the model gives alone.
        assert reply["choices"][0]["text"] == alone["choices"][0]["text"]
        # The disk tier found chunk 3 corrupt once, and dropped it (the recomputed chunk may be written back).
        worker = query_worker(socket, "stats")["stats"]
        assert worker["tiers"]["disk"]["corrupt"] == 1
        # (async_loads = "auto", the default, made that disk hit an asynchronous load: a synchronous
        # one that comes back short is recounted by the connector, the README's troubleshooting.)
    finally:
        server.close()
