"""HTTP to a vLLM OpenAI server: JSON in and out with a timeout on every call, the one-line
``ServerError``, and the check that a user's url answers and serves the policy.

Retries are the caller's (``ServerRollout``): whether a failed call is retried depends on
whether the server can be restarted.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping


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
):
    """JSON in, JSON out (None for an empty body); GET without ``body``, else POST. Raises
    ``urllib.error.URLError`` / ``OSError`` / ``TimeoutError`` on failure, ``ServerError`` on
    an HTTP error status."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method or ("GET" if body is None else "POST")
    )
    request.add_header("Content-Type", "application/json")
    for key, value in (headers or {}).items():
        request.add_header(key, value)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:300].replace("\n", " ")
        raise ServerError(f"{url}: HTTP {err.code}: {detail}") from None
    return json.loads(raw) if raw else None


def check_server_url(url: str, served_model_name: str, *, key: str, timeout_s: float) -> None:
    """The server at ``url`` answers ``/v1/models`` within ``timeout_s`` and serves
    ``served_model_name``; else a one-line ``ServerError`` naming ``key`` and the url."""
    try:
        models = request_json(f"{url.rstrip('/')}/v1/models", timeout=timeout_s)
    except (OSError, ServerError, ValueError) as err:
        reason = getattr(err, "reason", None) or err
        raise ServerError(f"'{key}': {url} does not answer ({reason})") from None
    names = [m.get("id") for m in (models or {}).get("data", [])]
    if served_model_name not in names:
        raise ServerError(
            f"'{key}': {url} serves {names}, not '{served_model_name}' "
            "(rollout.server.served_model_name)"
        )
