"""The rounds of ``flowkv bench side-by-side``: documents asked twice, for one vLLM engine in one process.

Every configuration of the side-by-side table (no connector, vLLM's own prefix
cache, flowkv's pipelines, LMCache's MP mode) runs this same workload in a
process of its own. LMCache runs in a virtual environment of its own, where
flowkv is not installed: so this module imports only the standard library at
the top and vLLM inside its functions, and ``examples/peers`` loads it by its
path.

The workload (`Workload`): ``docs`` documents of ``doc_tokens`` tokens, each
followed by a question of ``question_tokens`` tokens; random token ids drawn
past the tokenizer's special ones, the same for every configuration. Round 1
asks each document's first question (the document is computed, and a
connector stores it); round 2 asks each document a second question (a
connector, or vLLM's prefix cache when its pool holds every document, serves
the document). Each request generates one token: its time is the time to
first token. vLLM's own pool holds ``pool_docs`` documents (fewer than the
documents, so vLLM's prefix cache alone cannot serve round 2), but for the
floor, whose pool holds them all.

`ask_rounds` returns, per round and document, the seconds, the tokens vLLM
reported cached (``num_cached_tokens``) and the greedy token: JSON that the
parent process reads from the child's last line of output.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["ROOM", "Workload", "ask_rounds", "build_engine", "kv_bytes_per_token", "print_result"]

# Positions past the longest prompt in max_model_len: the generated token's.
ROOM = 16
# Token ids below this are the tokenizer's special ones.
_FIRST_ID = 16


@dataclass(frozen=True)
class Workload:
    """What every configuration is asked (see the module's docstring)."""

    docs: int = 8
    doc_tokens: int = 4096
    question_tokens: int = 32
    vocab: int = 2048
    #: documents vLLM's own pool holds (the floor's pool holds all of them)
    pool_docs: float = 2.5
    seed: int = 0

    def document(self, doc: int) -> list[int]:
        return _ids(self.doc_tokens, self.vocab, seed=self.seed * 1_000_003 + doc)

    def question(self, doc: int, round_index: int) -> list[int]:
        return _ids(self.question_tokens, self.vocab, seed=(self.seed * 1_000_003 + doc) * 7 + round_index + 1)

    def prompt(self, doc: int, round_index: int) -> list[int]:
        return self.document(doc) + self.question(doc, round_index)

    @property
    def max_model_len(self) -> int:
        return self.doc_tokens + self.question_tokens + ROOM

    def pool_bytes(self, kv_per_token: int, *, floor: bool = False) -> int:
        """vLLM's KV pool: ``pool_docs`` prompts, or (the floor) every document with room to spare."""
        prompts = self.docs + 1 if floor else max(1.0, self.pool_docs)
        return int(prompts * self.max_model_len * kv_per_token)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Workload:
        return cls(**json.loads(text))


def _ids(count: int, vocab: int, *, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(_FIRST_ID, vocab) for _ in range(count)]


def kv_bytes_per_token(model: Path) -> int:
    """Bytes of bf16 keys and values one token takes over every layer of the model in ``model``."""
    config = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * heads * head_dim * 2


def build_engine(model: Path, workload: Workload, *, kv_transfer_config: dict[str, Any] | None,
                 prefix_caching: bool = False, floor: bool = False, eager: bool = False) -> Any:
    """vLLM in this process's control (its engine in processes of its own, as a user runs it), bf16,
    the pool `Workload.pool_bytes` sizes; prefix caching off unless asked for, so that every reused
    token of a connected engine is the connector's."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(**kv_transfer_config) if kv_transfer_config else None
    return LLM(model=str(model), dtype="bfloat16", enable_prefix_caching=prefix_caching,
               max_model_len=workload.max_model_len, max_num_batched_tokens=workload.max_model_len,
               kv_cache_memory_bytes=workload.pool_bytes(kv_bytes_per_token(model), floor=floor),
               kv_transfer_config=transfer, enforce_eager=eager, disable_log_stats=True, seed=0)


def ask_rounds(llm: Any, workload: Workload, *, between: Callable[[], object] | None = None,
               before_hit: Callable[[], object] | None = None) -> dict[str, Any]:
    """Both rounds on ``llm``; ``between`` runs once after round 1 (e.g. waiting for a disk tier's
    writes), ``before_hit`` before each request of round 2, both untimed. Returns
    ``{"rounds": [round 1, round 2]}``, each a list (by document) of
    ``{"ttft_s", "cached_tokens", "token"}``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0)
    rounds: list[list[dict[str, Any]]] = []
    for round_index in (0, 1):
        if round_index == 1 and between is not None:
            between()
        asked = []
        for doc in range(workload.docs):
            prompt = TokensPrompt(prompt_token_ids=workload.prompt(doc, round_index))
            if round_index == 1 and before_hit is not None:
                before_hit()
            started = time.perf_counter()
            [output] = llm.generate([prompt], params, use_tqdm=False)
            seconds = time.perf_counter() - started
            asked.append({"ttft_s": seconds, "cached_tokens": int(output.num_cached_tokens or 0),
                          "token": int(output.outputs[0].token_ids[0])})
        rounds.append(asked)
    return {"rounds": rounds}


def print_result(result: dict[str, Any]) -> None:
    """The child's answer: one JSON line, the last of its output."""
    print(json.dumps(result), flush=True)
