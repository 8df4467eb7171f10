"""``flowkv controller``: one per fleet; registration, events, lookups, commands, metrics, dashboard.

The controller is never on the inference path: instances report to it in the
background and a router asks it before sending a request. Its state is soft
(:class:`flowkv.fleet.directory.Directory`), rebuilt from the instances'
snapshots and events after a restart. It binds to loopback unless told
otherwise, and every request but ``/health`` needs a bearer token of its role
(:mod:`flowkv.fleet.access`: instance, reader, operator), unless it runs
``--insecure`` (loopback only).

::

    flowkv controller --port 9100 --instance-token-file instances.tokens \
        --reader-token-file readers.tokens --operator-token-file operators.tokens

The API is described at ``/docs`` (OpenAPI); the dashboard is at ``/``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, Response
from pydantic import BaseModel, Field

from flowkv.exposition import exposition, family
from flowkv.fleet.access import Access, AccessMiddleware
from flowkv.fleet.directory import Directory
from flowkv.fleet.protocol import (
    Ack,
    EventBatch,
    Heartbeat,
    LookupReply,
    LookupRequest,
    Registration,
    Snapshot,
)
from flowkv.fleet.tokens import Tokenizers
from flowkv.tenants import sum_reports

__all__ = ["create_app", "serve"]

log = logging.getLogger("flowkv.fleet")

#: the longest a command waits for its results: a wait holds no worker thread, but a client should not hang
MAX_WAIT_S = 60.0
#: the longest a pin may last (a day); an instance can always be told to clear
MAX_TTL_S = 86_400.0


class ClearRequest(BaseModel):
    instance_id: str | None = Field(None, description="one instance; all when omitted")
    model: str | None = None
    tags: dict[str, str] = {}
    tiers: list[str] = Field([], description="these tiers only; all when empty")
    wait_s: float = Field(0.0, ge=0, le=MAX_WAIT_S, description="wait this long for the instances to confirm")


class ChunksCommand(BaseModel):
    """Tokens (or text) whose chunks an instance should pin or bring into memory."""

    instance_id: str | None = Field(None, description="one instance; default: every instance holding a prefix")
    token_ids: list[int] | None = None
    text: str | None = None
    model: str | None = None
    tags: dict[str, str] = {}
    ttl_s: float = Field(300.0, gt=0, le=MAX_TTL_S)
    wait_s: float = Field(0.0, ge=0, le=MAX_WAIT_S)


class CommandReply(BaseModel):
    instances: list[str]
    commands: list[int]
    results: dict[int, Any] = {}


def create_app(directory: Directory | None = None, *, access: Access | None = None,
               tokenizers: Tokenizers | None = None) -> FastAPI:
    """The controller's ASGI app; ``directory`` defaults to a new one, ``access`` to no tokens (insecure)."""
    directory = directory or Directory()
    access = access or Access()
    tokenizers = tokenizers or Tokenizers()
    stop = threading.Event()

    def reaper() -> None:
        interval = max(0.1, min(1.0, directory.timeout_s / 4))
        while not stop.wait(interval):
            for name in directory.reap():
                log.warning("flowkv controller: %s rank %d missed its heartbeats; marked down", *name)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        thread = threading.Thread(target=reaper, name="flowkv-controller-reaper", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()

    app = FastAPI(title="flowkv controller", version="1", lifespan=lifespan,
                  description="Who holds which KV prefix across a fleet of vLLM instances with flowkv.")
    app.state.directory = directory

    app.add_middleware(AccessMiddleware, access=access, counters=directory.counters)

    def own(request: Request, instance_id: str) -> None:
        """An instance reports for its own id only (the middleware checked its token already)."""
        refusal = access.claim(request.state.flowkv_token, instance_id)
        if refusal is not None:
            directory.counters["refused"] += 1
            raise HTTPException(status_code=403, detail=refusal)

    # -- from instances ---------------------------------------------------------

    @app.post("/v1/register", response_model=Ack, tags=["instances report"])
    def register(registration: Registration, request: Request) -> Ack:
        own(request, registration.instance_id)
        log.info("flowkv controller: %s rank %d registered (%s, pipeline %s)", registration.instance_id,
                 registration.rank, registration.model, registration.pipeline)
        return directory.register(registration)

    @app.post("/v1/snapshot", response_model=Ack, tags=["instances report"])
    def snapshot(snapshot: Snapshot, request: Request) -> Ack:
        own(request, snapshot.instance_id)
        return directory.snapshot(snapshot)

    @app.post("/v1/events", response_model=Ack, tags=["instances report"])
    def events(batch: EventBatch, request: Request) -> Ack:
        own(request, batch.instance_id)
        return directory.events(batch)

    @app.post("/v1/heartbeat", response_model=Ack, tags=["instances report"])
    def heartbeat(beat: Heartbeat, request: Request) -> Ack:
        own(request, beat.instance_id)
        return directory.heartbeat(beat)

    # -- queries ----------------------------------------------------------------

    def token_ids_of(body: LookupRequest | ChunksCommand) -> list[int]:
        if body.token_ids is not None:
            return body.token_ids
        if body.text is None:
            raise HTTPException(status_code=422, detail="give token_ids, or text and model")
        tokenizer = None
        for instance in directory.instances():
            if body.model is None or body.model in (instance["model"], instance["key_model"]):
                tokenizer = _tokenizer_of(directory, instance["instance_id"])
                if tokenizer:
                    break
        if tokenizer is None:
            raise HTTPException(status_code=422, detail=f"no registered instance serves model {body.model!r}, "
                                                        "so its tokenizer is unknown; give token_ids")
        try:
            return tokenizers.encode(tokenizer, prompt=body.text)
        except Exception as exc:  # a tokenizer that is not on this machine
            raise HTTPException(status_code=422, detail=f"cannot tokenize with {tokenizer!r}: {exc}") from None

    @app.post("/lookup", response_model=LookupReply, tags=["queries"])
    def lookup(body: LookupRequest) -> LookupReply:
        """Every instance holding a prefix of the tokens: matched tokens and tiers, longest first."""
        return directory.lookup(token_ids_of(body), model=body.model, tags=body.tags,
                                include_down=body.include_down)

    @app.get("/instances", tags=["queries"])
    def instances() -> list[dict[str, Any]]:
        """Every instance that registered: up or down, model, pipeline, tiers and their fill, last stats."""
        return directory.instances()

    @app.get("/health", tags=["queries"])
    async def health() -> dict[str, Any]:  # on the event loop: it needs no worker thread, so none can starve it
        listed = directory.instances()
        return {"status": "ok", "instances": len(listed),
                "up": sum(1 for i in listed if i["state"] == "up")}

    @app.get("/api/events", tags=["dashboard"])
    def recent_events(limit: int = Query(50, ge=0, le=1000)) -> list[dict[str, Any]]:
        return list(directory.recent)[-limit:][::-1]

    @app.get("/api/history", tags=["dashboard"])
    def history() -> dict[str, list[dict[str, Any]]]:
        """Per instance, one point per heartbeat: time and cumulative counters."""
        out = {}
        for instance_id, points in list(directory.history.items()):
            out[instance_id] = [{"t": t, "counters": s.get("counters", {}), "latency_ms": s.get("latency_ms", {})}
                                for t, s in list(points)]
        return out

    @app.get("/metrics", response_class=PlainTextResponse, tags=["queries"])
    def metrics() -> str:
        return _prometheus(directory) + _tenant_prometheus(directory)

    @app.get("/tenants", tags=["queries"])
    def tenants() -> dict[str, dict[str, int]]:
        """Per tenant, summed over the fleet's holders: bytes, entries, hits, misses, evictions."""
        return _fleet_tenants(directory)

    # -- commands ---------------------------------------------------------------

    async def results_of(ids: list[int], wait_s: float) -> dict[int, Any]:
        # Polled on the event loop: a waiting command holds no worker thread (the pool serves lookups).
        deadline = time.monotonic() + wait_s
        while True:
            done = directory.wait_results(ids, 0.0)
            if len(done) == len(ids) or time.monotonic() >= deadline:
                return done
            await asyncio.sleep(0.05)

    @app.post("/clear", response_model=CommandReply, tags=["commands"])
    async def clear(body: ClearRequest) -> CommandReply:
        """Drop chunks on one instance or all (optionally of a model, a tag set, some tiers)."""
        if body.instance_id is not None and not directory.known_instance(body.instance_id):
            raise HTTPException(status_code=404, detail=f"no instance {body.instance_id!r}")
        names, ids = directory.clear(body.instance_id, model=body.model, tags=body.tags, tiers=body.tiers)
        return CommandReply(instances=names, commands=ids, results=await results_of(ids, body.wait_s))

    async def chunk_command(op: str, body: ChunksCommand) -> CommandReply:
        tokens = await asyncio.to_thread(token_ids_of, body)
        if body.instance_id is not None:
            if not directory.known_instance(body.instance_id):
                raise HTTPException(status_code=404, detail=f"no instance {body.instance_id!r}")
            names = [body.instance_id]
        else:
            names = [h.instance_id for h in directory.lookup(tokens, model=body.model, tags=body.tags).holders]
        holders = [h for name in names for h in directory.holders_of(name)]
        ids = directory.command(holders, op, token_ids=tokens, tags=body.tags, ttl_s=body.ttl_s)
        return CommandReply(instances=names, commands=ids, results=await results_of(ids, body.wait_s))

    @app.post("/pin", response_model=CommandReply, tags=["commands"])
    async def pin(body: ChunksCommand) -> CommandReply:
        """Keep these tokens' chunks in memory for ``ttl_s`` (no eviction) on the instances that hold them."""
        return await chunk_command("pin", body)

    @app.post("/prefetch", response_model=CommandReply, tags=["commands"])
    async def prefetch(body: ChunksCommand) -> CommandReply:
        """Bring these tokens' chunks from an instance's lower tiers into its memory."""
        return await chunk_command("prefetch", body)

    # -- the dashboard ----------------------------------------------------------

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def dashboard() -> str:
        return _asset("index.html")

    @app.get("/dashboard.js", include_in_schema=False)
    def dashboard_js() -> Response:
        return Response(_asset("dashboard.js"), media_type="text/javascript")

    return app


def _tokenizer_of(directory: Directory, instance_id: str) -> str | None:
    for holder in directory.holders_of(instance_id):
        if holder.registration.tokenizer:
            return holder.registration.tokenizer
    return None


def _asset(name: str) -> str:
    return resources.files("flowkv.fleet").joinpath("dashboard", name).read_text(encoding="utf-8")


def _prometheus(directory: Directory) -> str:
    snapshot = directory.metrics()
    return exposition([
        family("gauge", "flowkv_controller_instances", "Instances known to the controller, by state.",
               [({"state": state}, snapshot["states"].get(state, 0)) for state in ("up", "down")]),
        family("gauge", "flowkv_controller_chunks", "Chunk keys the directory holds per instance and rank.",
               [({"instance": instance_id, "rank": rank}, count)
                for (instance_id, rank), count in sorted(snapshot["chunks"].items())]),
        family("counter", "flowkv_controller_messages_total",
               "Registrations, snapshots, events, lookups, commands.",
               [({"kind": name}, value) for name, value in sorted(snapshot["counters"].items())]),
        family("gauge", "flowkv_instance_counter", "An instance's flowkv counters, as its last heartbeat said.",
               [({"instance": instance_id, "rank": rank, "name": name}, value)
                for (instance_id, rank), stats in sorted(snapshot["stats"].items())
                for name, value in sorted((stats.get("counters") or {}).items())]),
    ])


def _fleet_tenants(directory: Directory) -> dict[str, dict[str, int]]:
    """Each holder's last per-tenant report (its heartbeat's ``stats.tenants``), summed per tenant."""
    return sum_reports([stats.get("tenants") or {} for stats in directory.metrics()["stats"].values()
                        if isinstance(stats, dict)])


_TENANT_METRICS = (
    ("bytes", "gauge", "Bytes each tenant holds, summed over the fleet's tiers"),
    ("entries", "gauge", "Entries each tenant holds, summed over the fleet's tiers"),
    ("hits", "counter", "Chunks each tenant read, summed over the fleet"),
    ("misses", "counter", "Chunks each tenant asked for and did not find, summed over the fleet"),
    ("evictions", "counter", "Entries of each tenant evicted, summed over the fleet"),
)


def _tenant_prometheus(directory: Directory) -> str:
    """``flowkv_fleet_tenant_*{tenant="..."}``: the fleet's per-tenant sums (a bounded label set)."""
    tenants = _fleet_tenants(directory)
    if not tenants:
        return ""
    return exposition(
        family(kind, f"flowkv_fleet_tenant_{field}" + ("_total" if kind == "counter" else ""), text,
               [({"tenant": label}, numbers[field]) for label, numbers in tenants.items()])
        for field, kind, text in _TENANT_METRICS)


def serve(app: FastAPI, host: str, port: int, *, name: str, log_level: str = "info",
          tls_cert: str | None = None, tls_key: str | None = None) -> None:
    """Run ``app`` on ``host:port`` (port 0: a free one), printing the address it listens on first.

    With ``tls_cert`` (and ``tls_key``, unless the certificate file holds the key too) it speaks HTTPS only.
    """
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound_host, bound_port = sock.getsockname()[:2]
    # Tests and scripts read this line to learn a port chosen with --port 0.
    scheme = "https" if tls_cert else "http"
    print(f"{name} listening on {scheme}://{bound_host}:{bound_port}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level.lower(), access_log=False,
                                           ssl_certfile=tls_cert, ssl_keyfile=tls_key))
    server.run(sockets=[sock])
