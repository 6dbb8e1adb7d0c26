"""HTTP to a vLLM OpenAI server: JSON in and out with a timeout on every call, the one-line
``ServerError``, and the check that a user's url answers and serves the policy.

Retries are the caller's (``ServerRollout``): whether a failed call is retried depends on
whether the server can be restarted.
"""

from __future__ import annotations

import json
import secrets
import urllib.error
import urllib.request
from collections.abc import Mapping

from otbrl.rollout.server_auth import IDENTITY_PATH, bearer, proof


class ServerError(RuntimeError):
    """A vLLM server failed (did not start, died past its restarts, or answered wrongly); the
    message is one line naming the server."""


def request_json(
    url: str,
    body: dict | None = None,
    *,
    timeout: float,
    method: str | None = None,
    headers: Mapping[str, str] | None = None,
    token: str | None = None,
):
    """JSON in, JSON out (None for an empty body); GET without ``body``, else POST; ``token``:
    the server's secret, sent as a bearer token. Raises ``urllib.error.URLError`` /
    ``OSError`` / ``TimeoutError`` on failure, ``ServerError`` on an HTTP error status."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method or ("GET" if body is None else "POST")
    )
    request.add_header("Content-Type", "application/json")
    for key, value in {**(headers or {}), **bearer(token)}.items():
        request.add_header(key, value)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:300].replace("\n", " ")
        raise ServerError(f"{url}: HTTP {err.code}: {detail}") from None
    return json.loads(raw) if raw else None


def check_identity(url: str, token: str, *, timeout_s: float) -> None:
    """The server at ``url`` proves it holds ``token`` (``otbrl.rollout.server_auth``); else a
    one-line ``ServerError``: another process on its port, or a server of another run."""
    nonce = secrets.token_hex(16)
    try:
        answer = request_json(
            f"{url.rstrip('/')}{IDENTITY_PATH}?nonce={nonce}", timeout=timeout_s, token=token
        )
    except (OSError, ServerError, ValueError) as err:
        reason = getattr(err, "reason", None) or err
        raise ServerError(
            f"{url} does not prove it holds this run's server secret ({reason}): another "
            "process on its port, or a server started without this run's OTBRL_SERVER_TOKEN"
        ) from None
    if not isinstance(answer, dict) or answer.get("proof") != proof(token, nonce):
        raise ServerError(f"{url} answered the identity challenge wrongly: not this run's server")


def check_server_url(
    url: str, served_model_name: str, *, key: str, timeout_s: float, token: str | None = None
) -> None:
    """The server at ``url`` answers ``/v1/models`` within ``timeout_s`` and serves
    ``served_model_name`` (and with ``token``, proves it holds it); else a one-line
    ``ServerError`` naming ``key`` and the url."""
    try:
        models = request_json(f"{url.rstrip('/')}/v1/models", timeout=timeout_s, token=token)
    except (OSError, ServerError, ValueError) as err:
        reason = getattr(err, "reason", None) or err
        raise ServerError(f"'{key}': {url} does not answer ({reason})") from None
    names = [m.get("id") for m in (models or {}).get("data", [])]
    if served_model_name not in names:
        raise ServerError(
            f"'{key}': {url} serves {names}, not '{served_model_name}' "
            "(rollout.server.served_model_name)"
        )
    if token:
        try:
            check_identity(url, token, timeout_s=timeout_s)
        except ServerError as err:
            raise ServerError(f"'{key}': {err}") from None
