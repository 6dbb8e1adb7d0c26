"""Every route of a vLLM server otbrl talks to answers only the run that holds its secret.

vLLM's ``--api-key`` guards the ``/v1`` routes only; the dev routes otbrl needs
(``/collective_rpc``, ``/pause``, ``/reset_prefix_cache``...) would let anyone who reaches the
port load other weights, write files as the server's user or stop the policy. So each server
runs with ``--middleware otbrl.rollout.server_auth.require_token`` and the run's secret in
``OTBRL_SERVER_TOKEN``: a request without ``Authorization: Bearer <secret>`` gets 401, whatever
its route. ``GET /otbrl/identity?nonce=N`` answers HMAC-SHA256(secret, N): the trainer checks
it before it trusts a server, so a process that took a user's server's port first, or a server
of another run, is found out instead of served the run's weights and prompts (the servers otbrl
starts listen on Unix sockets in a private directory: nobody can take their place).

This module is imported inside the vLLM server process: only the standard library at import
time (``fastapi``'s response class is vLLM's own dependency, imported on the first request).
"""

from __future__ import annotations

import hashlib
import hmac
import os

TOKEN_ENV = "OTBRL_SERVER_TOKEN"
IDENTITY_PATH = "/otbrl/identity"


def bearer(token: str | None) -> dict[str, str]:
    """The header that carries ``token`` (none without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def proof(token: str, nonce: str) -> str:
    """HMAC-SHA256 of ``nonce`` under ``token``, hex: what a server that holds the secret
    answers on ``IDENTITY_PATH``."""
    return hmac.new(token.encode(), nonce.encode(), hashlib.sha256).hexdigest()


def authorized(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header value is exactly ``Bearer <token>`` (constant-time;
    never with an empty ``token``). The servers' middleware and the trainer's weight server
    both check with it."""
    expected = bearer(token).get("Authorization", "")
    return bool(token) and hmac.compare_digest((header or "").encode(), expected.encode())


async def require_token(request, call_next):
    """ASGI HTTP middleware for ``vllm ... --middleware``: 401 unless the request carries the
    server's secret (``OTBRL_SERVER_TOKEN``; a server started without one refuses everything);
    answers the identity challenge itself."""
    from fastapi.responses import JSONResponse, PlainTextResponse

    token = os.environ.get(TOKEN_ENV, "")
    if not authorized(request.headers.get("authorization"), token):
        return PlainTextResponse("unauthorized: this server answers its otbrl run only", 401)
    if request.url.path == IDENTITY_PATH:
        return JSONResponse({"proof": proof(token, request.query_params.get("nonce", ""))})
    return await call_next(request)
