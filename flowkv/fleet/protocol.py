"""The messages between the holders of chunks (reporters) and the controller.

A *holder* is one process that holds chunks and reports them: a vLLM worker
(one per rank of an instance), or a node server whose tiers several vLLM
instances share. Holders are named ``(instance_id, rank)``; a node server is
an instance of ``kind = "server"`` with rank 0, and a vLLM instance that
reads through it lists it in ``shared``.

Every message names the holder's ``session`` (random per process start), so
the controller tells a restarted holder from one that lost messages.

::

    holder                                  controller
    POST /v1/register  Registration  ─────▶ (new session: its directory entries are dropped)
    POST /v1/snapshot  Snapshot      ─────▶ everything held, as of ``seq``
    POST /v1/events    EventBatch    ─────▶ events seq_from .. seq_from + n - 1
                                      ◀──── Ack: ok | resync (a gap) | register (unknown holder)
    POST /v1/heartbeat Heartbeat     ─────▶ stats; commands (clear, pin, prefetch) come back
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

__all__ = [
    "Ack",
    "Command",
    "CommandResult",
    "Event",
    "EventBatch",
    "Heartbeat",
    "LookupHolder",
    "LookupReply",
    "LookupRequest",
    "Registration",
    "Snapshot",
    "TierInfo",
]

#: the medium each tier kind is named by in vLLM's KV events
MEDIUM_OF_KIND = {"memory": "CPU", "disk": "DISK", "redis": "REDIS", "server": "CPU"}


class TierInfo(BaseModel):
    """One tier of a holder, in lookup order."""

    name: str
    kind: str  # memory, disk, redis, server, or a plugin's kind
    capacity_bytes: int | None = None


#: bounds on what a holder may declare (a controller refuses the rest with 422)
MAX_NAME = 512
MAX_RANK = 1 << 16
MAX_CHUNK_SIZE = 1 << 20

_InstanceId = Field(min_length=1, max_length=MAX_NAME)
_Rank = Field(0, ge=0, lt=MAX_RANK)
_Session = Field(min_length=1, max_length=MAX_NAME)


class Registration(BaseModel):
    """Who a holder is, and how to compute the keys it reports."""

    instance_id: str = _InstanceId
    rank: int = _Rank
    world_size: int = Field(1, ge=1, le=MAX_RANK)
    session: str = _Session
    kind: Literal["vllm", "server", "engine"] = "vllm"
    url: str | None = Field(None, description="where the instance serves requests (an OpenAI-compatible URL)")
    model: str = Field(description="the model name clients ask for (vLLM's served model name)")
    key_model: str | None = Field(None, description="the model name in cache keys (default: model)")
    tokenizer: str | None = Field(None, description="a tokenizer name or path, for lookups by text")
    pipeline: str = ""
    tiers: list[TierInfo] = []
    # > 0 for an instance (0 would break every lookup); a node server (kind "server") has none: 0
    chunk_size: int = Field(ge=0, le=MAX_CHUNK_SIZE)
    hash: str
    shared: list[str] = Field([], description="instance ids of node servers whose tiers this instance reads")

    @model_validator(mode="after")
    def _chunked(self) -> Registration:
        if self.kind != "server" and self.chunk_size == 0:
            raise ValueError(f"chunk_size must be > 0 for a {self.kind} holder (only a node server has none)")
        return self


class Event(BaseModel):
    """A tier admitted a chunk, let it go (evict, remove), or dropped everything (clear, key empty)."""

    op: Literal["admit", "evict", "remove", "clear"]
    tier: str
    key: str = ""


class EventBatch(BaseModel):
    instance_id: str = _InstanceId
    rank: int = _Rank
    session: str = _Session
    seq_from: int = Field(description="the sequence number of events[0]; numbers run on without gaps")
    events: list[Event]


class Snapshot(BaseModel):
    """Everything a holder holds, as of after event ``seq`` (it replaces what the controller knew)."""

    instance_id: str = _InstanceId
    rank: int = _Rank
    session: str = _Session
    seq: int
    tiers: dict[str, list[str]]


class Command(BaseModel):
    """Work the controller asks a holder to do; it is carried by the reply to a heartbeat."""

    id: int
    op: Literal["clear", "pin", "prefetch"]
    token_ids: list[int] = []
    tags: dict[str, str] = {}
    tiers: list[str] = []  # clear: these tiers only (all when empty)
    ttl_s: float = 300.0  # pin


class CommandResult(BaseModel):
    id: int
    ok: bool
    detail: str = ""


class Heartbeat(BaseModel):
    instance_id: str = _InstanceId
    rank: int = _Rank
    session: str = _Session
    seq: int = Field(description="the last event sequence number the holder sent")
    stats: dict[str, Any] = {}
    done: list[CommandResult] = []


class Ack(BaseModel):
    """The controller's answer to a holder.

    ``register``: the controller does not know this holder's session (it
    restarted, or declared the holder gone): register, then send a snapshot.
    ``resync``: a gap in sequence numbers: send a snapshot.
    """

    status: Literal["ok", "resync", "register"]
    commands: list[Command] = []
    heartbeat_s: float | None = None


class LookupRequest(BaseModel):
    """Who holds the longest prefix of these tokens (or of this text, tokenized for ``model``)."""

    token_ids: list[int] | None = None
    text: str | None = None
    model: str | None = None
    tags: dict[str, str] = {}
    include_down: bool = False


class LookupHolder(BaseModel):
    instance_id: str
    url: str | None
    model: str
    state: Literal["up", "down"]
    matched_tokens: int
    matched_chunks: int
    tier: str | None = Field(description="the slowest tier the matched prefix needs (its last chunks' tier)")
    chunks_by_tier: dict[str, int]


class LookupReply(BaseModel):
    num_tokens: int
    holders: list[LookupHolder]
