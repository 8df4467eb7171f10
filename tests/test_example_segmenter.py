"""The example segmenter (examples/segmenter): chunks that end at document boundaries
let a prompt reuse a whole document, where fixed-size chunks stop at the last boundary inside it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowkv import CacheEngine
from flowkv.kernels import KVGeometry, gather
from flowkv.testing import make_paged_kv, random_slot_mapping

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "segmenter"
SEP = [7, 7]
CHUNK = 64
BLOCKS = 64


@pytest.fixture(autouse=True)
def on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))


def doc(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(100, 2000, (n,), generator=g)).tolist() + SEP


def make(pipeline: str, g: KVGeometry) -> CacheEngine:
    overrides = {"chunk_size": CHUNK, "tiers.memory.capacity": "8MiB"}
    return CacheEngine.from_pipeline(pipeline, geometry=g, model_name="tiny", overrides=overrides)


def set_separator(text: str) -> str:
    return text.replace("separator = [10, 10, 10]", f"separator = {SEP}")


def test_boundaries() -> None:
    from flowkv_segmenter import boundaries

    assert boundaries([1, 2, 7, 7, 3, 4, 5], SEP, 100) == [4, 7]
    assert boundaries([1, 2, 3, 4, 5], SEP, 2) == [2, 4, 5]
    assert boundaries([7, 7, 7, 7], SEP, 100) == [2, 4]


def test_a_whole_document_is_reused(tmp_path) -> None:
    pipeline = tmp_path / "rag.toml"
    pipeline.write_text(set_separator((EXAMPLE / "rag-segments.toml").read_text()))
    g = KVGeometry("cpu", num_layers=2, num_kv_heads=2, head_size=16, block_size=16, dtype=torch.bfloat16)
    a, b, c = doc(1, 98), doc(2, 50), doc(3, 40)
    question = [11, 12, 13, 14, 15]
    first = torch.tensor(a + b + question)
    second = torch.tensor(a + c + question)
    src = make_paged_kv(g, BLOCKS, seed=0)
    slots = random_slot_mapping(len(first), g, BLOCKS, seed=1)

    segmented = make(str(pipeline), g)
    fixed = make("local-cpu", g)
    assert segmented.store(first, kv_caches=src, slot_mapping=slots) == len(a) + len(b)  # the question is not stored
    fixed.store(first, kv_caches=src, slot_mapping=slots)

    assert segmented.lookup(second) == len(a)  # all of document A (100 tokens)
    assert fixed.lookup(second) == CHUNK  # fixed chunks: only the first 64

    dst = make_paged_kv(g, BLOCKS, seed=2, fill=False)
    mask = segmented.retrieve(second, kv_caches=dst, slot_mapping=slots)
    assert int(mask.sum()) == len(a) and bool(mask[: len(a)].all())
    hit = slots[: len(a)]
    want = gather(src, g, hit, torch.empty(g.chunk_shape(len(a)), dtype=g.dtype))
    got = gather(dst, g, hit, torch.empty(g.chunk_shape(len(a)), dtype=g.dtype))
    assert torch.equal(got, want)
