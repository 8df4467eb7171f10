"""``flowkv route``: an OpenAI-compatible proxy that sends each request where its prefix is cached.

For each ``/v1/completions`` or ``/v1/chat/completions`` request the router
tokenizes the prompt as vLLM will (:mod:`flowkv.fleet.tokens`), asks the
controller's ``/lookup`` which instances hold a prefix, and picks:

1. the holder with the longest cached prefix, unless it has more than
   ``max_in_flight_gap`` requests in flight beyond the least loaded backend
   (then the next holder, and so on);
2. among holders with equal prefixes, the one with fewer requests in flight;
3. when nobody holds a prefix yet, the backend this router sent the same
   opening (the first ``affinity_tokens`` tokens) to within the last
   ``affinity_s`` seconds: a repeat that arrives while the first request is
   still being prefilled, or before its chunks were reported, waits for
   them there instead of computing them a second time elsewhere;
4. otherwise (or when the controller does not answer within
   ``lookup_timeout_s``), the backend with the fewest requests in flight,
   round-robin among equals.

``policy="round-robin"`` skips all that (the comparison mode).

**Disaggregated prefill** (``prefill=[...]``; the backends are then the
decode instances): a request goes first to the least loaded prefill instance
as a non-streamed request for one token (``max_tokens=1``) with
``kv_transfer_params`` ``{"do_remote_decode": true}``, and the
``kv_transfer_params`` of its answer (what the prefill instance committed to
the shared tier, :mod:`flowkv.integration.vllm.disagg`) go with the client's
request, streamed or not, to a decode instance chosen as above. A prefill
instance that fails or cannot be reached costs only the split: the decode
instance computes the prompt itself, and one that cannot be reached is passed
over for ``prefill_retry_s``. Responses,
streamed or not, are passed through unchanged, with an ``x-flowkv-backend``
header naming the backend that served them.

A request body must be a JSON object of at most ``max_body_bytes`` (400 and
413 otherwise, before any backend is asked); a backend that cannot be reached
answers 502, one silent past ``read_timeout_s`` 504. Whatever happens to a
request, its upstream response is closed and its backend's in-flight count
goes down again: a leaked count would skew every later choice.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import ssl
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from flowkv.fleet.tokens import Tokenizers

__all__ = ["Router", "create_app"]

log = logging.getLogger("flowkv.fleet")


def _normal(url: str) -> str:
    return url.rstrip("/").replace("://localhost", "://127.0.0.1")


class Router:
    """Which backend gets a request; see the module's docstring."""

    def __init__(self, backends: list[str], *, controller: str | None = None, policy: str = "prefix",
                 tokenizer: str | None = None, max_in_flight_gap: int = 8, lookup_timeout_s: float = 2.0,
                 affinity_tokens: int = 256, affinity_s: float = 60.0, controller_token: str | None = None,
                 connect_timeout_s: float = 10.0, read_timeout_s: float = 600.0,
                 max_body_bytes: int = 16 << 20, controller_ca_file: str | None = None,
                 prefill: list[str] | None = None, prefill_retry_s: float = 5.0) -> None:
        if not backends:
            raise ValueError("flowkv route needs at least one backend" if prefill is None
                             else "flowkv route --prefill needs at least one --decode instance")
        if policy not in ("prefix", "round-robin"):
            raise ValueError(f"unknown policy {policy!r}: prefix or round-robin")
        self.backends = [_normal(url) for url in backends]
        self.controller = controller.rstrip("/") if controller else None
        self.policy = policy
        self.tokenizer = tokenizer
        self.max_in_flight_gap = max_in_flight_gap
        self.lookup_timeout_s = lookup_timeout_s
        # the controller's reader token (its /lookup needs one unless it runs --insecure)
        self.controller_token = controller_token
        self.connect_timeout_s = connect_timeout_s
        # the longest a backend may stay silent: before its first byte (a long prefill) or between two
        self.read_timeout_s = read_timeout_s
        self.max_body_bytes = max_body_bytes
        self.controller_ca_file = controller_ca_file
        self.in_flight = {url: 0 for url in self.backends}
        # Prefill instances (disaggregated prefill): requests in flight, and until when one that could not be
        # reached is passed over (time.monotonic()).
        self.prefill = {_normal(url): 0 for url in prefill or ()}
        self.prefill_retry_s = prefill_retry_s
        self._prefill_down: dict[str, float] = {}
        self._prefill_turn = itertools.count()
        self.affinity_tokens = affinity_tokens
        self.affinity_s = affinity_s
        # opening of a prompt -> (backend, monotonic time) of the last request this router sent with it
        self._recent: collections.OrderedDict[int, tuple[str, float]] = collections.OrderedDict()
        self._turn = itertools.count()
        self.tokenizers = Tokenizers()
        self.decisions: collections.Counter[str] = collections.Counter()
        self.served: collections.Counter[str] = collections.Counter()
        self.client: httpx.AsyncClient | None = None

    async def open(self) -> None:
        # pool: waiting for a free connection is bounded like connecting, so a stuck pool fails a request, not
        # every request
        timeout = httpx.Timeout(connect=self.connect_timeout_s, read=self.read_timeout_s, write=self.read_timeout_s,
                                pool=self.connect_timeout_s)
        # Backends and an https:// controller alike: certificates checked (against this CA bundle when given).
        verify = ssl.create_default_context(cafile=self.controller_ca_file) if self.controller_ca_file else True
        self.client = httpx.AsyncClient(timeout=timeout, verify=verify,
                                        limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    # -- choosing -------------------------------------------------------------------

    def _least_loaded(self, among: list[str] | None = None) -> str:
        return _least_loaded(self.in_flight, among or self.backends, self._turn)

    async def choose(self, body: dict[str, Any], chat: bool) -> tuple[str, str, int]:
        """(backend, why, matched tokens) for a request body."""
        if self.policy == "round-robin":
            return self.backends[next(self._turn) % len(self.backends)], "round-robin", 0
        try:
            token_ids = await asyncio.to_thread(self._token_ids, body, chat)
            holders = await self._lookup(token_ids, body.get("model"))
        except Exception as exc:  # no tokenizer, no controller: route by load, never fail the request
            if self.decisions["lookup-failed"] % 100 == 0:
                log.warning("flowkv route: lookup failed (%s: %s); routing by load", type(exc).__name__, exc)
            return self._least_loaded(), "lookup-failed", 0
        floor = min(self.in_flight.values())
        best: list[tuple[str, int]] = []
        for holder in holders:
            url = _normal(holder.get("url") or "")
            if url not in self.in_flight or holder.get("state") != "up":
                continue
            if self.in_flight[url] - floor > self.max_in_flight_gap:
                self.decisions["holder_overloaded"] += 1
                continue
            if best and holder["matched_tokens"] < best[0][1]:
                break
            best.append((url, holder["matched_tokens"]))
        opening = hash(tuple(token_ids[:self.affinity_tokens]))
        if best:
            chosen = best[0][0] if len(best) == 1 else self._least_loaded([url for url, _ in best])
            why = "longest-prefix" if len(best) == 1 else "tie-by-load"
        else:
            recent = self._recent.get(opening)
            if (recent is not None and time.monotonic() - recent[1] < self.affinity_s
                    and self.in_flight[recent[0]] - floor <= self.max_in_flight_gap):
                chosen, why = recent[0], "recent-affinity"
            else:
                chosen, why = self._least_loaded(), "no-holder"
        self._recent[opening] = (chosen, time.monotonic())
        self._recent.move_to_end(opening)
        while len(self._recent) > 10_000:
            self._recent.popitem(last=False)
        return chosen, why, best[0][1] if best else 0

    def _token_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        tokenizer = self.tokenizer or self._backend_model_root
        if chat:
            return self.tokenizers.encode(tokenizer, messages=body.get("messages") or [])
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of prompts goes where its first one is cached
        return self.tokenizers.encode(tokenizer, prompt=prompt)

    _backend_model_root: str | None = None

    async def learn_tokenizer(self) -> None:
        """The backends' model path (``root`` in vLLM's ``/v1/models``), when no tokenizer was given."""
        if self.tokenizer or self._backend_model_root or self.client is None:
            return
        for url in self.backends:
            try:
                reply = await self.client.get(f"{url}/v1/models", timeout=5.0)
                models = reply.json().get("data") or []
                if models:
                    self._backend_model_root = models[0].get("root") or models[0].get("id")
                    return
            except Exception:
                continue

    async def _lookup(self, token_ids: list[int], model: str | None) -> list[dict[str, Any]]:
        assert self.client is not None and self.controller is not None
        headers = {"Authorization": f"Bearer {self.controller_token}"} if self.controller_token else {}
        reply = await self.client.post(f"{self.controller}/lookup", json={"token_ids": token_ids},
                                       headers=headers, timeout=self.lookup_timeout_s)
        reply.raise_for_status()
        return reply.json()["holders"]

    # -- disaggregated prefill ----------------------------------------------------------

    def _prefill_instance(self) -> str | None:
        """The least loaded prefill instance not passed over, round-robin among equals (None: none up)."""
        now = time.monotonic()
        up = [url for url in self.prefill if self._prefill_down.get(url, 0.0) <= now]
        return _least_loaded(self.prefill, up, self._prefill_turn) if up else None

    async def prefill_for(self, body: dict[str, Any], path: str, headers: dict[str, str]) -> tuple[str, Any]:
        """Run a request's prefill on a prefill instance: (instance or "none", the ``kv_transfer_params`` its
        answer carries, None when it gave none or failed)."""
        url = self._prefill_instance()
        if url is None:
            self.decisions["prefill-none-up"] += 1
            return "none", None
        ask = {key: value for key, value in body.items()
               if key not in ("stream", "stream_options", "max_completion_tokens", "min_tokens", "n")}
        ask.update(max_tokens=1, stream=False,
                   kv_transfer_params={**_params(body), "do_remote_decode": True, "do_remote_prefill": False})
        assert self.client is not None
        self.served[url] += 1
        self.prefill[url] += 1
        try:
            reply = await self.client.post(f"{url}{path}", json=ask, headers=headers)
            if reply.status_code != 200:
                self.decisions["prefill-refused"] += 1
                log.warning("flowkv route: prefill instance %s answered %d: %s", url, reply.status_code,
                            reply.text[:200])
                return url, None
            params = reply.json().get("kv_transfer_params")
        except httpx.TimeoutException as exc:
            self.decisions["prefill-failed"] += 1
            log.warning("flowkv route: prefill instance %s gave no answer in time (%s)", url, type(exc).__name__)
            return url, None
        except (httpx.HTTPError, ValueError) as exc:
            self.decisions["prefill-failed"] += 1
            if isinstance(exc, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)):
                self._prefill_down[url] = time.monotonic() + self.prefill_retry_s
            log.warning("flowkv route: prefill instance %s failed (%s: %s); the decode instance computes the "
                        "prompt", url, type(exc).__name__, exc)
            return url, None
        finally:
            self.prefill[url] -= 1
        self._prefill_down.pop(url, None)
        self.decisions["prefilled"] += 1
        return url, params if isinstance(params, dict) else None

    # -- proxying -------------------------------------------------------------------

    async def _body(self, request: Request) -> bytes | None:
        """The request's body, or None past ``max_body_bytes`` (read no further than that)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return None
        raw = bytearray()
        async for piece in request.stream():
            raw += piece
            if len(raw) > self.max_body_bytes:
                return None
        return bytes(raw)

    async def forward(self, request: Request, path: str, chat: bool) -> Response:
        raw = await self._body(request)
        if raw is None:
            return _error(413, f"the body is larger than {self.max_body_bytes} bytes", "invalid_request")
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            return _error(400, "the body is not JSON", "invalid_request")
        if not isinstance(body, dict):
            return _error(400, f"the body must be a JSON object, not {type(body).__name__}", "invalid_request")
        if self.tokenizer is None and self._backend_model_root is None:
            await self.learn_tokenizer()
        forwarded = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        prefilled_by = None
        if self.prefill:
            # Before the decode instance is chosen: its prefix is in the shared tier by then.
            prefilled_by, params = await self.prefill_for(body, path, forwarded)
            if params is not None:
                raw = json.dumps({**body, "kv_transfer_params": {**_params(body), **params}}).encode()
        backend, why, matched = await self.choose(body, chat)
        self.decisions[why] += 1
        self.served[backend] += 1
        headers = {"x-flowkv-backend": backend, "x-flowkv-route": why, "x-flowkv-matched-tokens": str(matched)}
        if prefilled_by is not None:
            headers["x-flowkv-prefill"] = prefilled_by
        assert self.client is not None
        self.in_flight[backend] += 1
        upstream: httpx.Response | None = None
        released = handed_over = False

        async def release() -> None:
            # Once per request, from whichever path ends it first.
            nonlocal released
            if released:
                return
            released = True
            self.in_flight[backend] -= 1
            if upstream is not None:
                await upstream.aclose()

        try:
            upstream = await self.client.send(
                self.client.build_request("POST", f"{backend}{path}", content=raw, headers=forwarded), stream=True)
            headers["content-type"] = upstream.headers.get("content-type", "application/json")
            if body.get("stream"):
                relayed = _Relayed(upstream, release, headers)
                handed_over = True  # the relay releases it when its stream ends
                return relayed
            content = await upstream.aread()
            return Response(content, status_code=upstream.status_code, headers=headers)
        except httpx.TimeoutException as exc:
            return _error(504, f"backend {backend}: no answer in time ({type(exc).__name__})", "backend_error",
                          headers)
        except httpx.HTTPError as exc:
            return _error(502, f"backend {backend}: {exc}", "backend_error", headers)
        finally:
            if not handed_over:
                await release()


def _least_loaded(load: dict[str, int], among: list[str], turn: Iterator[int]) -> str:
    """The URL of ``among`` with the fewest requests in flight (``load``); round-robin among the least
    loaded (``turn`` counts the picks), so equal instances share the work."""
    fewest = min(load[url] for url in among)
    least = [url for url in among if load[url] == fewest]
    return least[next(turn) % len(least)]


def _params(body: dict[str, Any]) -> dict[str, Any]:
    """The client's own ``kv_transfer_params`` (flowkv's tags among them), kept on both legs."""
    params = body.get("kv_transfer_params")
    return dict(params) if isinstance(params, dict) else {}


def _error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status, headers=headers)


class _Relayed(StreamingResponse):
    """A streamed upstream response passed on piece by piece; ``release`` runs however the stream ends."""

    def __init__(self, upstream: httpx.Response, release: Any, headers: dict[str, str]) -> None:
        self._release = release

        async def pieces():
            try:
                async for piece in upstream.aiter_raw():
                    yield piece
            except httpx.HTTPError as exc:  # the backend went silent or away mid-stream: end the stream
                log.warning("flowkv route: stream from %s ended early (%s)", headers["x-flowkv-backend"],
                            type(exc).__name__)
            finally:
                await release()

        super().__init__(pieces(), status_code=upstream.status_code, headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # A client that leaves before the first piece never starts the generator, so its finally never runs.
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._release()


def create_app(router: Router) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await router.open()
        try:
            yield
        finally:
            await router.close()

    app = FastAPI(title="flowkv route", version="1", lifespan=lifespan,
                  description="An OpenAI-compatible proxy that routes by cached prefix.")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.forward(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.forward(request, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models() -> Response:
        assert router.client is not None
        for url in router.backends:
            try:
                reply = await router.client.get(f"{url}/v1/models", timeout=5.0)
                return Response(reply.content, status_code=reply.status_code, media_type="application/json")
            except httpx.HTTPError:
                continue
        return JSONResponse({"error": {"message": "no backend answered"}}, 502)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "policy": router.policy, "backends": router.backends,
                **({"prefill": list(router.prefill)} if router.prefill else {})}

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return {"policy": router.policy, "in_flight": router.in_flight, "served": dict(router.served),
                "decisions": dict(router.decisions),
                **({"prefill_in_flight": router.prefill} if router.prefill else {})}

    return app
