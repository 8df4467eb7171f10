"""Tensor parallel: ``vllm serve --tensor-parallel-size 2`` with flowkv, one core per rank.

Two eager float32 servers for the whole module, each with two workers
(``VLLM_CPU_OMP_THREADS_BIND="0|1"``): one without a connector (the reference
outputs) and one with flowkv on ``local-cpu`` (plus a store stage that lets one
rank keep less of a tagged request). Every rank stores and loads its own shard
of each chunk, under keys that carry the world size and its rank; the
scheduler's hit is the minimum over the ranks' answers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import vllm  # noqa: F401 - a broken vLLM install fails these tests; it never skips them

from rank_stages import RANK_GAP_TAG
from vllm_helpers import CHUNK_SIZE, random_tokens
from vllm_server import README, VllmServer, shell_commands, start_server

from flowkv.pipeline import dumps_pipeline

pytestmark = pytest.mark.vllm

TESTS = Path(__file__).resolve().parent
DOC_TOKENS = 2048  # eight chunks
QUESTIONS = [random_tokens(8100 + i, 40) for i in range(3)]
MAX_TOKENS = 12


def readme_tp_line() -> tuple[dict[str, str], list[str], dict | None]:
    """The README's "Tensor parallel" command as a user types it: the variables its ``export`` line
    sets, the ``vllm serve`` flags but the model and the transfer config, and that config."""
    commands = shell_commands(README.read_text(encoding="utf-8"))
    for at, (_, argv) in enumerate(commands):
        if argv[:2] == ["vllm", "serve"] and "--tensor-parallel-size" in argv:
            break
    else:
        raise LookupError("README.md has no vllm serve line with --tensor-parallel-size")
    exported = commands[at - 1][1] if at and commands[at - 1][1][0] == "export" else []
    env = dict(assignment.split("=", 1) for assignment in exported[1:])
    flags, transfer = [], None
    rest = iter(argv[3:])  # past "vllm serve MODEL"
    for flag in rest:
        value = next(rest)
        if flag == "--kv-transfer-config":
            transfer = json.loads(value)
        else:
            flags += [flag, value]
    return env, flags, transfer


def tp_server(folder: Path, kv_extra: dict | None = None) -> VllmServer:
    """The README's tensor-parallel line (its environment, flags and transfer config; ``kv_extra`` over
    that config), or without ``kv_extra`` the same server unconnected."""
    env, flags, transfer = readme_tp_line()
    # the workers import the pipeline's test stage
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    return start_server(folder, kv_extra=kv_extra, transfer=transfer, compiled=False, dtype="float32", env=env,
                        args=flags)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp")
    pipeline = folder / "local-cpu-rank-gap.toml"
    pipeline.write_text(dumps_pipeline(
        pipeline={"name": "local-cpu-rank-gap", "chunk_size": CHUNK_SIZE},
        tiers={"memory": {"kind": "memory", "capacity": "256MiB"}},
        store=["tokenize", "chunk-hash", "rank_stages:rank_gap", "allocate", "gather", ("compress", {"codec": "none"}),
               "put"],
        retrieve=["tokenize", "chunk-hash", "lookup", "get", "decompress", "scatter"]), encoding="utf-8")
    started: dict[str, VllmServer] = {}
    try:
        started["reference"] = tp_server(folder / "reference")
        started["flowkv"] = tp_server(folder / "flowkv", {"pipeline": str(pipeline)})
        yield started
    finally:
        for instance in started.values():
            instance.close()


def ask(instance: VllmServer, prompt: list[int], tags: dict[str, str] | None = None) -> tuple[list[int], int]:
    """Greedy token ids and the prompt tokens flowkv loaded."""
    params = {f"flowkv.tag.{name}": value for name, value in (tags or {}).items()}
    reply = instance.complete(prompt, max_tokens=MAX_TOKENS, ignore_eos=True,
                              **({"kv_transfer_params": params} if params else {}))
    details = reply["usage"].get("prompt_tokens_details") or {}
    return reply["choices"][0]["token_ids"], details.get("cached_tokens") or 0


def test_both_ranks_store_and_load_their_shards_of_a_repeated_document(servers):
    reference, flowkv = servers["reference"], servers["flowkv"]
    doc = random_tokens(8000, DOC_TOKENS)
    for n, question in enumerate(QUESTIONS):
        output, cached = ask(flowkv, doc + question)
        assert output == ask(reference, doc + question)[0], n
        # The first ask computes the document; every later one loads all of it (>= 90 %: all eight chunks).
        assert cached == (0 if n == 0 else DOC_TOKENS), n
    assert flowkv.metric("vllm:flowkv_retrieved_tokens_total") >= 2 * DOC_TOKENS


def test_a_chunk_one_rank_lacks_shortens_the_hit_to_the_chunks_every_rank_holds(servers):
    reference, flowkv = servers["reference"], servers["flowkv"]
    doc = random_tokens(8001, DOC_TOKENS)
    # Rank 1 keeps the document's first three chunks only; rank 0 all eight.
    tags = {RANK_GAP_TAG: "1:3"}
    first, cached = ask(flowkv, doc + QUESTIONS[0], tags)
    assert cached == 0 and first == ask(reference, doc + QUESTIONS[0])[0]
    output, cached = ask(flowkv, doc + QUESTIONS[1], tags)
    assert cached == 3 * CHUNK_SIZE
    assert output == ask(reference, doc + QUESTIONS[1])[0]
    # And the other way round: rank 0 lacking the chunks from the sixth on leaves five.
    tags = {RANK_GAP_TAG: "0:5"}
    ask(flowkv, doc + QUESTIONS[0], tags)
    output, cached = ask(flowkv, doc + QUESTIONS[1], tags)
    assert cached == 5 * CHUNK_SIZE and output == ask(reference, doc + QUESTIONS[1])[0]
