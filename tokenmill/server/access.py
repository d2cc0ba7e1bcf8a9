"""Who may use the server beyond its API key: the paths the key guards, the Host header
allow-list that keeps a web page from reaching a loopback server by DNS rebinding, and the web
origins whose pages may call it and read its answers (CORS, none unless named).

A page on a name the attacker controls can re-point that name at 127.0.0.1 and then read the
server's answers as same-origin; its requests still carry the attacker's name in the Host
header, which a loopback server answers only for its own names.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.middleware.cors import CORSMiddleware

from tokenmill.server.protocol import error_body
from tokenmill.server.streaming import ApiKeyMiddleware, send_error

# The names a loopback server answers to (any port).
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


class FullApiKeyMiddleware(ApiKeyMiddleware):
    """The API key on the usual paths and also on /metrics and the API's docs and schema (what
    `--protect-metrics-and-docs` asks for); /health and /version stay open."""

    PROTECTED = ApiKeyMiddleware.PROTECTED + ("/metrics", "/docs", "/redoc", "/openapi.json")


def host_entry(name: str) -> str:
    """An allow-list entry as the Host header spells it: lower case, an IPv6 address in brackets."""
    name = name.strip().lower()
    return f"[{name}]" if ":" in name and not name.startswith("[") else name


def host_name(header: bytes) -> str:
    """A Host header's name without its port: b"[::1]:8000" -> "[::1]", b"Localhost:80" -> "localhost"."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[:text.find("]") + 1] if "]" in text else text
    return text.partition(":")[0]


class HostAllowListMiddleware:
    """400 for a request whose Host header names none of `hosts` (any port), before anything
    else reads it. A request without a Host header passes: browsers always send one."""

    def __init__(self, app, hosts: Iterable[str]) -> None:
        self.app, self.hosts = app, frozenset(host_entry(h) for h in hosts)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            host = dict(scope.get("headers") or []).get(b"host")
            if host is not None and host_name(host) not in self.hosts:
                return await send_error(send, 400, error_body(
                    f"this server does not answer for the host {host_name(host)!r} (start it with "
                    "--allowed-hosts to add names)", param="host", code="invalid_host"))
        await self.app(scope, receive, send)


def add_cors(app, origins: list[str] | None) -> None:
    """Let pages on `origins` ("*": any) call `app` and read its answers; None: no answer is marked
    readable by another origin. Added after the API key's middleware, it runs before it: a
    browser's preflight carries no key and is answered here. A page on a public origin may then
    reach a server on a private address too (Private Network Access), its origin being allowed."""
    if origins is not None:
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"],
                           allow_private_network=True)
