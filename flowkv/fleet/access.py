"""Who may ask the controller what: roles and their tokens, the Host allow-list, body bounds.

Three roles, each with its own bearer tokens:

``instance``
    a holder's reports (``/v1/register``, ``/v1/snapshot``, ``/v1/events``,
    ``/v1/heartbeat``), each for its own instance id only: the first token
    that reports an id owns it (a line ``TOKEN ID...`` in the token file
    fixes the ids a token may report for, across controller restarts too).
``reader``
    the queries: ``/lookup``, ``/instances``, ``/tenants``, ``/metrics``, ``/api/*``, the
    API description (``/docs``, ``/openapi.json``): what ``flowkv route`` and
    people use.
``operator``
    the commands (``/clear``, ``/pin``, ``/prefetch``), and whatever a reader
    may.

``/health`` needs no token, nor do the dashboard's two static files (the
page asks for a reader token and sends it with each of its calls). Every
request, ``/health`` included, must name an allowed host in ``Host`` (and in
``Origin`` when a browser sends one): a web page that rebinds its own name
to 127.0.0.1 reaches a loopback port, but with its own name in ``Host``.

The check runs as ASGI middleware, before a body is read: a request without
the right token, or with a body over its bound, is refused unread.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fastapi import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["ROLES", "Access", "AccessMiddleware", "LOOPBACK_NAMES", "allowed_hosts", "read_tokens"]

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
ROLES = ("instance", "reader", "operator")

_INSTANCE_PATHS = ("/v1/register", "/v1/snapshot", "/v1/events", "/v1/heartbeat")
_OPERATOR_PATHS = ("/clear", "/pin", "/prefetch")
_OPEN_PATHS = ("/health", "/", "/dashboard.js")


@dataclass(frozen=True)
class Token:
    secret: str
    # the instance ids this token may report for; empty: any id no other token owns
    instance_ids: tuple[str, ...] = ()


def read_tokens(path: Path) -> list[Token]:
    """The tokens of a token file: one a line (``TOKEN`` or ``TOKEN ID...``); ``#`` starts a comment."""
    tokens = []
    for line in Path(path).expanduser().read_text(encoding="utf-8").splitlines():
        words = line.split("#", 1)[0].split()
        if words:
            tokens.append(Token(words[0], tuple(words[1:])))
    if not tokens:
        raise ValueError(f"token file {path} holds no token")
    return tokens


@dataclass
class Access:
    """The controller's tokens per role (none: ``--insecure``), allowed host names and body bounds."""

    tokens: dict[str, list[Token]] = field(default_factory=dict)
    allowed_hosts: frozenset[str] = frozenset(LOOPBACK_NAMES)
    max_body_bytes: int = 4 << 20  # queries and commands
    max_report_bytes: int = 256 << 20  # an instance's snapshot lists every key it holds
    # instance id -> the token that owns it (soft state, like the directory)
    _owners: dict[str, str] = field(default_factory=dict)

    @property
    def insecure(self) -> bool:
        return not any(self.tokens.values())

    def role_of(self, path: str) -> str | None:
        if path in _OPEN_PATHS:
            return None
        if path in _INSTANCE_PATHS:
            return "instance"
        if path in _OPERATOR_PATHS:
            return "operator"
        return "reader"

    def match(self, role: str, authorization: str) -> Token | None:
        """The token of ``role`` (or, for a reader, of an operator) that ``authorization`` carries."""
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return None
        given_bytes = given.strip().encode()
        found = None
        for name in ("reader", "operator") if role == "reader" else (role,):
            for token in self.tokens.get(name, ()):
                # Compare with every token (constant time each), so timing tells nothing about which matched.
                if hmac.compare_digest(given_bytes, token.secret.encode()) and found is None:
                    found = token
        return found

    def claim(self, token: Token | None, instance_id: str) -> str | None:
        """Why ``token`` may not report for ``instance_id`` (None: it may; the first report claims the id)."""
        if token is None:  # --insecure
            return None
        if token.instance_ids:
            return None if instance_id in token.instance_ids else \
                f"this token may report for {', '.join(token.instance_ids)} only, not {instance_id!r}"
        for other in self.tokens.get("instance", ()):
            if other is not token and instance_id in other.instance_ids:
                return f"instance id {instance_id!r} belongs to another token"
        owner = self._owners.setdefault(instance_id, token.secret)
        if owner != token.secret:
            return f"instance id {instance_id!r} was registered with another token"
        return None

    def host_allowed(self, value: str) -> bool:
        host = _hostname(value)
        return host is not None and host in self.allowed_hosts

    def origin_allowed(self, origin: str) -> bool:
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and parts.hostname is not None \
            and parts.hostname.lower() in self.allowed_hosts


def _hostname(host_header: str) -> str | None:
    value = host_header.strip().lower()
    if value.startswith("["):  # [::1]:9100
        end = value.find("]")
        return value[1:end] if end > 0 else None
    name, _, port = value.rpartition(":") if value.count(":") == 1 else (value, "", "")
    if port and not port.isdigit():
        return None
    return name or None


def allowed_hosts(bound: str, extra: Iterable[str]) -> frozenset[str]:
    """Loopback names, the address bound when it is one address (not 0.0.0.0 or ::), and ``extra``."""
    names = set(LOOPBACK_NAMES) | {name.strip().lower().strip("[]") for name in extra if name.strip()}
    if bound not in ("0.0.0.0", "::", ""):
        names.add(bound.lower().strip("[]"))
    return frozenset(names)


class AccessMiddleware:
    """Refuses what :class:`Access` does not allow, before the app reads a byte of the body."""

    def __init__(self, app: ASGIApp, access: Access, counters: Any = None) -> None:
        self.app = app
        self.access = access
        self.counters = counters

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        access = self.access
        if not access.host_allowed(headers.get("host", "")):
            await _refuse(send, 403, f"host {headers.get('host', '')!r} is not allowed (flowkv controller "
                                     "--allow-host NAME adds one)")
            return
        origin = headers.get("origin")
        if origin is not None and not access.origin_allowed(origin):
            await _refuse(send, 403, f"origin {origin!r} is not allowed")
            return
        role = access.role_of(scope["path"])
        token = None
        if role is not None and not access.insecure:
            token = access.match(role, headers.get("authorization", ""))
            if token is None:
                if self.counters is not None:
                    self.counters["refused"] += 1
                await _refuse(send, 401, f"a valid bearer token of the {role} role is required",
                              [(b"www-authenticate", b"Bearer")])
                return
        limit = access.max_report_bytes if role == "instance" else access.max_body_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await _refuse(send, 413, f"the body is larger than {limit} bytes")
            return
        scope.setdefault("state", {})["flowkv_token"] = token
        received = 0

        async def bounded_receive() -> Any:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # a chunked body that ran past its bound
                    raise HTTPException(status_code=413, detail=f"the body is larger than {limit} bytes")
            return message

        await self.app(scope, bounded_receive, send)


async def _refuse(send: Send, status: int, detail: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})
