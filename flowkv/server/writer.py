"""The node server's writer: each chunk committed to the arena runs the pipeline's ``[server]`` list.

::

    commit (loop thread) ──queue──▶ writer thread: Runner([server] list)  e.g. compress ──▶ put
                                      one run per chunk, spans "flowkv.server" > "compress", "put"

The list is a pipeline's own stage list, run by flowkv's runner like an
engine's (a failing stage is named, a traced server records a span per
stage); its source items are the committed chunks, each keyed, in its arena
object, with its KV viewed in place (or, committed encoded by its client, as
its payload). ``put`` writes every tier but the arena the chunk is in, through
each lower tier's write-behind queue. The stages get a `flowkv.items.Services`
without a geometry or keys: one server holds the chunks of many engines.

A server pipeline written as an engine's (store and retrieve lists, no
``[server]`` list) runs the stages of its store list after the transfer that
gathers KV that may run in a server (its codec, its puts); with no store list
either, ``put`` alone.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from typing import Any

from flowkv.items import Chunk, Request, RunContext, Services
from flowkv.pipeline_model import Pipeline, StageSpec
from flowkv.registry import PIPELINE_KINDS, Role, resolve_stage
from flowkv.runner import BoundStage, Runner, StageError
from flowkv.tenants import TENANT_TAG
from flowkv.tiers import node_protocol as wire
from flowkv.tiers.manager import StorageManager

__all__ = ["ServerWriter", "server_stages"]

log = logging.getLogger("flowkv.server")

_QUEUED = 1024  # committed chunks waiting for the writer; more are dropped (counted)


class ServerWriter:
    """Runs the ``[server]`` list over committed chunks on a thread of its own.

    ``arena`` is the segment's tensor (uint8) the arena objects lie in;
    ``counters`` take ``lower_dropped``, ``lower_errors`` and what the stages count.
    """

    def __init__(self, pipeline: Pipeline | None, *, storage: StorageManager, arena: Any, counters: Any,
                 tracer: Any) -> None:
        self._arena = arena
        self._counters = counters
        self.stages = server_stages(pipeline)
        self._runner = Runner(self.stages, kind="server", pipeline=pipeline.name if pipeline else "server",
                              tracer=tracer)
        section = pipeline.section if pipeline is not None else None
        self._services = Services(geometry=None, keys=None, storage=storage, counters=counters,
                                  chunk_size=section.chunk_size if section else 256,
                                  save_partial_chunks=section.save_partial_chunks if section else False)
        # (key, arena object with a reference for the writer, its tenant); None stops the thread.
        self._queue: queue.Queue[tuple[str, Any, str] | None] = queue.Queue(maxsize=_QUEUED)
        self._thread = threading.Thread(target=self._run, name="flowkv-node-lower", daemon=True)
        self._thread.start()

    def offer(self, key: str, obj: Any, tenant: str) -> None:
        """Queue a committed chunk for the lower tiers (a full queue drops it, counted: a later miss)."""
        obj.ref_up()  # the writer's, until its run is over
        try:
            self._queue.put_nowait((key, obj, tenant))
        except queue.Full:
            obj.ref_down()
            self._counters.count("lower_dropped")

    def queued(self) -> int:
        return self._queue.qsize()

    def close(self) -> None:
        """Run every chunk queued so far, then stop."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, obj, tenant = item
            try:
                self._write(key, obj, tenant)
            except Exception:  # one chunk that cannot be written is a later miss, never a stop
                log.exception("flowkv server: writing %s to the lower tiers failed", key)
                self._counters.count("lower_errors")
            finally:
                obj.ref_down()

    def _write(self, key: str, obj: Any, tenant: str) -> None:
        meta = obj.meta
        kv = payload = None
        if "codec" in meta:  # its client encoded it: the bytes are the payload
            payload = bytes(obj.view_bytes()[: meta["encoded_len"]])
        else:
            kv = wire.view(self._arena, obj.tensor.data_ptr() - self._arena.data_ptr(), meta["shape"],
                           wire.dtype_from_name(meta["dtype"]), meta.get("order"))
        # A chunk is a stored prefix of its own here: the server knows no request around it.
        tokens = int(kv.shape[2]) if kv is not None and kv.dim() == 5 else 0
        request = Request(tokens=None, length=tokens, tags={TENANT_TAG: tenant})
        chunk = Chunk(request, 0, 0, tokens, key_str=key, obj=obj, kv=kv, payload=payload, tier="memory")
        ctx = RunContext(kind="server", services=self._services)
        try:
            self._runner.run([chunk], ctx)
        except StageError:
            log.exception("flowkv server: the [server] list failed on %s", key)
            self._counters.count("lower_errors")
        finally:
            ctx.run_deferred()


def server_stages(pipeline: Pipeline | None) -> Sequence[StageSpec | BoundStage]:
    """What the writer runs on each committed chunk: the pipeline's ``[server]`` list, or for a
    file without one its store list's stages after the last transfer that may run in a server
    (the others are left out, and logged), or with no store list either ``put`` alone."""
    if pipeline is None:
        return []
    if pipeline.server:
        return pipeline.server
    transfers = [i for i, spec in enumerate(pipeline.store) if spec.info.role is Role.TRANSFER]
    if not transfers:
        info = resolve_stage("put")
        return [BoundStage(name=info.name, func=info.func, settings=info.config_kwargs(info.make_config()),
                           takes_ctx=info.takes_ctx, location=f"{pipeline.source} (no [server] list: put)",
                           index=0, role=str(info.role))]
    tail = pipeline.store[transfers[-1] + 1:]
    for spec in tail:
        if "server" not in spec.info.kinds:
            log.warning("flowkv server: stage '%s' of %s (%s) cannot run in a node server (it runs in: %s): the "
                        "lower tiers get chunks without it; declare a [server] list", spec.name, pipeline.source,
                        spec.location.short, ", ".join(k for k in PIPELINE_KINDS if k in spec.info.kinds))
    return [spec for spec in tail if "server" in spec.info.kinds]
