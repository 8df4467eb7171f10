"""Chunk hashing and cache keys (flowkv.keys)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from flowkv.keys import (
    HASH_FUNCTIONS,
    CacheKey,
    KeyPrefix,
    chain_hashes,
    chunk_spans,
    default_hash_function_name,
    get_hash_function,
    tags_digest,
)

ALL_FUNCTIONS = sorted(HASH_FUNCTIONS)
TOKENS = [(i * 7919 + 13) % 151_000 for i in range(1000)]


def _prefix(**overrides):
    fields = dict(model="meta-llama/Llama-3.1-8B", world_size=2, worker_rank=1,
                  dtype="bfloat16", layout="lbhnc-h2-d64", tags={"lora": "sql", "cache_salt": "t1"})
    fields.update(overrides)
    return KeyPrefix.build(**fields)


# -- chunk spans ---------------------------------------------------------------


def test_chunk_spans_full_and_partial():
    assert chunk_spans(600, 256, save_partial=True) == [(0, 256), (256, 512), (512, 600)]
    assert chunk_spans(600, 256, save_partial=False) == [(0, 256), (256, 512)]
    assert chunk_spans(512, 256, save_partial=True) == [(0, 256), (256, 512)]
    assert chunk_spans(0, 256, save_partial=True) == []
    assert chunk_spans(5, 256, save_partial=True) == [(0, 5)]
    assert chunk_spans(5, 256, save_partial=False) == []


@pytest.mark.parametrize("num_tokens,chunk_size", [(-1, 4), (4, 0), (4, -2), (4.0, 2), (4, True)])
def test_chunk_spans_rejects_bad_input(num_tokens, chunk_size):
    with pytest.raises(ValueError):
        chunk_spans(num_tokens, chunk_size, save_partial=True)


# -- hash functions by name ------------------------------------------------------


def test_get_hash_function_by_name():
    for name in ALL_FUNCTIONS:
        fn = get_hash_function(name)
        assert fn.name == name
        assert len(fn.root_hash) == fn.digest_size
    assert set(ALL_FUNCTIONS) == {"sha256_cbor", "sha256", "xxh3_128"}


def test_unknown_name_lists_valid_names_and_suggests():
    with pytest.raises(ValueError) as info:
        get_hash_function("sha265")
    message = str(info.value)
    assert "did you mean 'sha256'" in message
    for name in ALL_FUNCTIONS:
        assert name in message


@pytest.mark.parametrize("name", ["hash", "builtin", "xxhash"])
def test_nondeterministic_names_are_refused_with_reason(name):
    with pytest.raises(ValueError, match="not deterministic across processes"):
        get_hash_function(name)


def test_default_follows_vllm_presence():
    import importlib.util

    expected = "sha256_cbor" if importlib.util.find_spec("vllm") else "sha256"
    assert default_hash_function_name() == expected


# -- chaining --------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_FUNCTIONS)
def test_equal_prefixes_share_keys_and_a_change_propagates(name):
    base = chain_hashes(TOKENS, 128, name)
    longer = chain_hashes(TOKENS + [5, 6, 7], 128, name)
    assert len(base) == 8 and len(set(base)) == 8
    # Full chunks are shared; the partial tail differs because it has more tokens.
    assert longer[:7] == base[:7]
    assert longer[7] != base[7]

    changed = list(TOKENS)
    changed[3] += 1  # inside chunk 0
    changed_hashes = chain_hashes(changed, 128, name)
    assert all(a != b for a, b in zip(base, changed_hashes))

    late = list(TOKENS)
    late[300] += 1  # inside chunk 2
    late_hashes = chain_hashes(late, 128, name)
    assert late_hashes[:2] == base[:2]
    assert all(a != b for a, b in zip(base[2:], late_hashes[2:]))


@pytest.mark.parametrize("name", ALL_FUNCTIONS)
def test_partial_chunk_handling(name):
    with_partial = chain_hashes(TOKENS, 256, name, partial=True)
    without = chain_hashes(TOKENS, 256, name, partial=False)
    assert len(with_partial) == 4 and len(without) == 3
    assert with_partial[:3] == without
    # A partial chunk never has the key of a full chunk or of a shorter partial.
    shorter = chain_hashes(TOKENS[:-1], 256, name)
    assert shorter[:3] == without and shorter[3] != with_partial[3]
    # Fewer tokens than one chunk: one partial hash, or nothing.
    assert len(chain_hashes(TOKENS[:10], 256, name)) == 1
    assert chain_hashes(TOKENS[:10], 256, name, partial=False) == []
    assert chain_hashes([], 256, name) == []


@pytest.mark.parametrize("name", ALL_FUNCTIONS)
def test_input_kinds_give_equal_hashes(name):
    expected = chain_hashes(TOKENS, 100, name)
    assert chain_hashes(tuple(TOKENS), 100, name) == expected
    assert chain_hashes(np.array(TOKENS, dtype=np.int64), 100, name) == expected
    assert chain_hashes(np.array(TOKENS, dtype=np.int32), 100, name) == expected
    assert chain_hashes(torch.tensor(TOKENS, dtype=torch.int64), 100, name) == expected
    assert chain_hashes(torch.tensor(TOKENS, dtype=torch.int32), 100, name) == expected
    # A non-contiguous view hashes its own elements.
    doubled = torch.tensor(TOKENS, dtype=torch.int64).repeat_interleave(2)
    assert chain_hashes(doubled[::2], 100, name) == expected


@pytest.mark.parametrize("name", ALL_FUNCTIONS)
def test_extra_keys_and_parent_continue_the_chain(name):
    plain = chain_hashes(TOKENS, 256, name)
    assert chain_hashes(TOKENS, 256, name, extra=("img-abc",)) != plain
    assert chain_hashes(TOKENS, 256, name, extra=("img-abc",)) == chain_hashes(TOKENS, 256, name, extra=("img-abc",))
    # Hashing the tail with the last full chunk's hash as parent continues the chain.
    tail = chain_hashes(TOKENS[512:], 256, name, parent=plain[1])
    assert tail == plain[2:]
    fn = get_hash_function(name)
    assert fn.hash_chunk(None, TOKENS[:256]) == plain[0]
    assert fn.hash_chunk(plain[0], TOKENS[256:512]) == plain[1]


@pytest.mark.parametrize("name", ALL_FUNCTIONS)
@pytest.mark.parametrize("bad", [[1.5, 2.0], [[1, 2]], ["a"], [2**70], [2**32], [-1],
                                 np.array([1.0]), np.array([-3]), torch.tensor([2**33])])
def test_bad_token_ids_are_refused(name, bad):
    with pytest.raises(ValueError):
        chain_hashes(bad, 2, name)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        chain_hashes(torch.zeros(2, 4, dtype=torch.int64), 2, "sha256")
    with pytest.raises(ValueError):
        chain_hashes(torch.zeros(4), 2, "sha256")  # float tensor
    with pytest.raises(TypeError):
        chain_hashes("1234", 2, "sha256")
    with pytest.raises(TypeError):
        chain_hashes([1, 2], 2, "sha256", extra=["not", "a", "tuple"])
    with pytest.raises(ValueError):
        chain_hashes([1, 2], 2, "sha256", extra=(object(),))
    with pytest.raises(ValueError):
        chain_hashes([1, -2], 2, "sha256")
    with pytest.raises(ValueError):
        chain_hashes([1, 2], 2, "sha256", parent=b"short")


_CHILD = r"""
import json, sys
from flowkv.keys import KeyPrefix, chain_hashes
tokens = list(range(1000, 1700))
out = {}
for name in ("sha256_cbor", "sha256", "xxh3_128"):
    out[name] = [h.hex() for h in chain_hashes(tokens, 256, name, extra=("salt",))]
prefix = KeyPrefix.build(model="org/m", world_size=2, worker_rank=1, dtype="float16",
                         layout="x", tags={"b": "2", "a": "1"})
out["key"] = prefix.key(bytes.fromhex(out["sha256"][0])).to_str()
json.dump(out, sys.stdout)
"""


def test_hashes_and_keys_equal_across_processes_with_different_hash_seeds():
    runs = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        result = subprocess.run([sys.executable, "-c", _CHILD], env=env, check=True,
                                capture_output=True, text=True)
        runs.append(json.loads(result.stdout))
    assert runs[0] == runs[1]
    # ...and equal to this process's own answer.
    tokens = list(range(1000, 1700))
    assert runs[0]["xxh3_128"] == [h.hex() for h in chain_hashes(tokens, 256, "xxh3_128", extra=("salt",))]


def test_sha256_cbor_matches_vllm_block_hashes():
    """With chunk_size == block_size flowkv's chunk hashes are vLLM's block hashes,
    so the connector can reuse what vLLM already computed."""
    if os.environ.get("PYTHONHASHSEED"):
        pytest.skip("vLLM derives its root hash from PYTHONHASHSEED when it is set")
    from vllm.v1.core import kv_cache_utils
    from vllm.utils.hashing import sha256_cbor

    kv_cache_utils.init_none_hash(sha256_cbor)
    block_size = 128
    parent, vllm_hashes = None, []
    for start in range(0, 896, block_size):
        parent = kv_cache_utils.hash_block_tokens(sha256_cbor, parent, TOKENS[start:start + block_size],
                                                  ("lora-a",))
        vllm_hashes.append(bytes(parent))
    assert chain_hashes(TOKENS, block_size, "sha256_cbor", extra=("lora-a",), partial=False) == vllm_hashes


# -- keys ------------------------------------------------------------------------


def test_key_string_round_trip_and_format():
    prefix = _prefix()
    chunk_hash = chain_hashes(TOKENS, 256, "sha256")[0]
    key = prefix.key(chunk_hash)
    text = key.to_str()
    assert text == (f"meta-llama%2FLlama-3.1-8B/2.1/bfloat16/lbhnc-h2-d64/"
                    f"{tags_digest({'lora': 'sql', 'cache_salt': 't1'})}/{chunk_hash.hex()}")
    assert CacheKey.from_str(text) == key
    assert hash(CacheKey.from_str(text)) == hash(key)
    # Printable and safe as a Redis key or a path made of these components.
    assert all(c.isalnum() or c in "._~%-/" for c in text)


def test_model_names_are_sanitised_without_collisions():
    chunk_hash = b"\x01" * 16
    names = ["org/model", "org%2Fmodel", "org_model", "org model", "../../etc/passwd", "Org/Model", "orgé/m"]
    texts = {KeyPrefix.build(model=n, world_size=1, worker_rank=0, dtype="float16",
                             layout="l").key(chunk_hash).to_str() for n in names}
    assert len(texts) == len(names)
    for text in texts:
        assert text.count("/") == 5
        assert CacheKey.from_str(text).to_str() == text
        assert text.split("/")[0] not in ("..", ".")
    assert KeyPrefix.build(model="../../etc/passwd", world_size=1, worker_rank=0, dtype="float16",
                           layout="l").to_str().split("/")[0] == "..%2F..%2Fetc%2Fpasswd"


@pytest.mark.parametrize("change", [
    dict(model="meta-llama/Llama-3.1-70B"),
    dict(world_size=4),
    dict(worker_rank=0),
    dict(dtype="float16"),
    dict(layout="nhd-h2-d64"),
    dict(tags={"lora": "sql"}),
    dict(tags={"lora": "sql", "cache_salt": "t2"}),
    dict(tags={}),
])
def test_incompatible_kv_never_shares_a_key(change):
    chunk_hash = chain_hashes(TOKENS, 256, "sha256")[0]
    base = _prefix().key(chunk_hash)
    other = _prefix(**change).key(chunk_hash)
    assert other != base
    assert other.to_str() != base.to_str()


def test_tags_are_order_independent():
    a = _prefix(tags={"lora": "sql", "cache_salt": "t1"})
    b = _prefix(tags={"cache_salt": "t1", "lora": "sql"})
    assert a == b and a.to_str() == b.to_str()
    assert tags_digest(None) == tags_digest({}) == "notags"
    # Keys and values cannot be shifted into each other.
    assert tags_digest({"ab": "c"}) != tags_digest({"a": "bc"})


def test_torch_dtype_is_named():
    assert _prefix(dtype=torch.bfloat16) == _prefix(dtype="bfloat16")


@pytest.mark.parametrize("bad", [
    dict(world_size=0), dict(worker_rank=2), dict(worker_rank=-1), dict(model=""),
    dict(layout=""), dict(dtype="bf 16"), dict(tags={"lora": 3}),
])
def test_bad_prefix_fields_are_refused(bad):
    with pytest.raises((ValueError, TypeError)):
        _prefix(**bad)


@pytest.mark.parametrize("text", [
    "", "a/b", "m/1.0/float16/l/notags/zz", "m/x.0/float16/l/notags/00", "m/1.1/float16/l/notags/00",
    "m/1.0/float16/l/badtags/00", "m/1.0/float16/l/notags/0", "m%2f/1.0/float16/l/notags/00",
])
def test_from_str_refuses_non_keys(text):
    with pytest.raises(ValueError):
        CacheKey.from_str(text)
