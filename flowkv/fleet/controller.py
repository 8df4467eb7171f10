"""``flowkv controller``: one per fleet; registration, events, lookups, commands, metrics, dashboard.

The controller is never on the inference path: instances report to it in the
background and a router asks it before sending a request. Its state is soft
(:class:`flowkv.fleet.directory.Directory`), rebuilt from the instances'
snapshots and events after a restart. It binds to loopback unless told
otherwise; with ``--token-file`` every request that changes state (reports
from instances and commands) needs ``Authorization: Bearer <token>``.

::

    flowkv controller --host 127.0.0.1 --port 9100 --token-file /etc/flowkv/token

The API is described at ``/docs`` (OpenAPI); the dashboard is at ``/``.
"""

from __future__ import annotations

import hmac
import logging
import threading
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, Response
from pydantic import BaseModel, Field

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


class ClearRequest(BaseModel):
    instance_id: str | None = Field(None, description="one instance; all when omitted")
    model: str | None = None
    tags: dict[str, str] = {}
    tiers: list[str] = Field([], description="these tiers only; all when empty")
    wait_s: float = Field(0.0, description="wait this long for the instances to confirm")


class ChunksCommand(BaseModel):
    """Tokens (or text) whose chunks an instance should pin or bring into memory."""

    instance_id: str | None = Field(None, description="one instance; default: every instance holding a prefix")
    token_ids: list[int] | None = None
    text: str | None = None
    model: str | None = None
    tags: dict[str, str] = {}
    ttl_s: float = 300.0
    wait_s: float = 0.0


class CommandReply(BaseModel):
    instances: list[str]
    commands: list[int]
    results: dict[int, Any] = {}


def create_app(directory: Directory | None = None, *, token: str | None = None,
               tokenizers: Tokenizers | None = None) -> FastAPI:
    """The controller's ASGI app; ``directory`` defaults to a new one."""
    directory = directory or Directory()
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

    def authorized(request: Request) -> None:
        if token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            directory.counters["refused"] += 1
            raise HTTPException(status_code=401, detail="a valid bearer token is required",
                                headers={"WWW-Authenticate": "Bearer"})

    guarded = [Depends(authorized)]

    # -- from instances ---------------------------------------------------------

    @app.post("/v1/register", response_model=Ack, dependencies=guarded, tags=["instances report"])
    def register(registration: Registration) -> Ack:
        log.info("flowkv controller: %s rank %d registered (%s, pipeline %s)", registration.instance_id,
                 registration.rank, registration.model, registration.pipeline)
        return directory.register(registration)

    @app.post("/v1/snapshot", response_model=Ack, dependencies=guarded, tags=["instances report"])
    def snapshot(snapshot: Snapshot) -> Ack:
        return directory.snapshot(snapshot)

    @app.post("/v1/events", response_model=Ack, dependencies=guarded, tags=["instances report"])
    def events(batch: EventBatch) -> Ack:
        return directory.events(batch)

    @app.post("/v1/heartbeat", response_model=Ack, dependencies=guarded, tags=["instances report"])
    def heartbeat(beat: Heartbeat) -> Ack:
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
    def health() -> dict[str, Any]:
        listed = directory.instances()
        return {"status": "ok", "instances": len(listed),
                "up": sum(1 for i in listed if i["state"] == "up")}

    @app.get("/api/events", tags=["dashboard"])
    def recent_events(limit: int = 50) -> list[dict[str, Any]]:
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

    @app.post("/clear", response_model=CommandReply, dependencies=guarded, tags=["commands"])
    def clear(body: ClearRequest) -> CommandReply:
        """Drop chunks on one instance or all (optionally of a model, a tag set, some tiers)."""
        if body.instance_id is not None and not directory.known_instance(body.instance_id):
            raise HTTPException(status_code=404, detail=f"no instance {body.instance_id!r}")
        names, ids = directory.clear(body.instance_id, model=body.model, tags=body.tags, tiers=body.tiers)
        results = directory.wait_results(ids, body.wait_s) if body.wait_s > 0 else {}
        return CommandReply(instances=names, commands=ids, results=results)

    def chunk_command(op: str, body: ChunksCommand) -> CommandReply:
        tokens = token_ids_of(body)
        if body.instance_id is not None:
            if not directory.known_instance(body.instance_id):
                raise HTTPException(status_code=404, detail=f"no instance {body.instance_id!r}")
            names = [body.instance_id]
        else:
            names = [h.instance_id for h in directory.lookup(tokens, model=body.model, tags=body.tags).holders]
        holders = [h for name in names for h in directory.holders_of(name)]
        ids = directory.command(holders, op, token_ids=tokens, tags=body.tags, ttl_s=body.ttl_s)
        results = directory.wait_results(ids, body.wait_s) if body.wait_s > 0 else {}
        return CommandReply(instances=names, commands=ids, results=results)

    @app.post("/pin", response_model=CommandReply, dependencies=guarded, tags=["commands"])
    def pin(body: ChunksCommand) -> CommandReply:
        """Keep these tokens' chunks in memory for ``ttl_s`` (no eviction) on the instances that hold them."""
        return chunk_command("pin", body)

    @app.post("/prefetch", response_model=CommandReply, dependencies=guarded, tags=["commands"])
    def prefetch(body: ChunksCommand) -> CommandReply:
        """Bring these tokens' chunks from an instance's lower tiers into its memory."""
        return chunk_command("prefetch", body)

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
    lines = [
        "# HELP flowkv_controller_instances Instances known to the controller, by state.",
        "# TYPE flowkv_controller_instances gauge",
    ]
    for state in ("up", "down"):
        lines.append(f'flowkv_controller_instances{{state="{state}"}} {snapshot["states"].get(state, 0)}')
    lines += ["# HELP flowkv_controller_chunks Chunk keys the directory holds per instance and rank.",
              "# TYPE flowkv_controller_chunks gauge"]
    for (instance_id, rank), count in sorted(snapshot["chunks"].items()):
        lines.append(f'flowkv_controller_chunks{{instance="{_label(instance_id)}",rank="{rank}"}} {count}')
    lines += ["# HELP flowkv_controller_messages_total Registrations, snapshots, events, lookups, commands.",
              "# TYPE flowkv_controller_messages_total counter"]
    for name, value in sorted(snapshot["counters"].items()):
        lines.append(f'flowkv_controller_messages_total{{kind="{name}"}} {value}')
    lines += ["# HELP flowkv_instance_counter An instance's flowkv counters, as its last heartbeat said.",
              "# TYPE flowkv_instance_counter gauge"]
    for (instance_id, rank), stats in sorted(snapshot["stats"].items()):
        for name, value in sorted((stats.get("counters") or {}).items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                lines.append(f'flowkv_instance_counter{{instance="{_label(instance_id)}",rank="{rank}",'
                             f'name="{_label(name)}"}} {value}')
    return "\n".join(lines) + "\n"


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
    lines: list[str] = []
    for field, kind, text in _TENANT_METRICS:
        name = f"flowkv_fleet_tenant_{field}" + ("_total" if kind == "counter" else "")
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        lines += [f'{name}{{tenant="{_label(label)}"}} {numbers[field]}' for label, numbers in tenants.items()]
    return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def serve(app: FastAPI, host: str, port: int, *, name: str, log_level: str = "info") -> None:
    """Run ``app`` on ``host:port`` (port 0: a free one), printing the address it listens on first."""
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound_host, bound_port = sock.getsockname()[:2]
    # Tests and scripts read this line to learn a port chosen with --port 0.
    print(f"{name} listening on http://{bound_host}:{bound_port}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level.lower(), access_log=False))
    server.run(sockets=[sock])
