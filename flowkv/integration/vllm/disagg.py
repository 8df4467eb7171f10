"""Disaggregated prefill through a shared tier: what a prefill and a decode instance tell each other.

A prefill instance (``kv_role = "kv_producer"``) computes a prompt and stores
its KV in a tier both instances reach (the node server, Redis); a decode
instance (``"kv_consumer"``) loads it from there. No KV goes between them:
only a small dict in ``kv_transfer_params``, the field vLLM's OpenAI server
takes on a request and returns on its response, in the shape vLLM's own P/D
connectors use::

    client ──▶ router ──▶ prefill   {"do_remote_decode": true}, max_tokens 1
                       ◀── response {"do_remote_prefill": true, "do_remote_decode": false,
                                     "flowkv_committed_tokens": 1920}
                      ──▶ decode    the client's request + those params
                                    (vLLM's scheduler asks the connector again while
                                     the tier holds fewer than 1,920 of the prompt's tokens)

- The prefill side's ``request_finished`` answers a request that asked
  ``do_remote_decode`` with the tokens it asked flowkv to store: they are
  stored by then (saves finish inside the step that computed them), though a
  write-behind tier may commit them later.
- The decode side's ``get_num_new_matched_tokens`` answers ``None`` ("ask
  again later": vLLM keeps the request waiting and asks on a later step) while
  the tier holds less of the prompt than was committed, up to ``[vllm]
  remote_prefill_wait_ms``; then it loads what the tier holds (nothing, if the
  tier is gone: the decode instance computes the prompt itself).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["COMMITTED_TOKENS", "committed_tokens", "prefill_answer", "wants_remote_decode"]

# The prompt tokens, from token 0, the prefill instance asked flowkv to store.
COMMITTED_TOKENS = "flowkv_committed_tokens"


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """Whether a request asks to be prefilled here and decoded elsewhere."""
    return bool(params) and bool(params.get("do_remote_decode"))


def prefill_answer(stored_tokens: int) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill instance returns: the decode request carries them."""
    return {"do_remote_prefill": True, "do_remote_decode": False, COMMITTED_TOKENS: stored_tokens}


def committed_tokens(params: Mapping[str, Any] | None) -> int | None:
    """The tokens a decode request's prefill instance committed (None: it was not prefilled elsewhere).

    The params come from the client through the router: anything but a
    non-negative int is ignored, never an error in vLLM's engine core.
    """
    if not params or not params.get("do_remote_prefill"):
        return None
    value = params.get(COMMITTED_TOKENS)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value
