"""HTTP to a vLLM OpenAI server: JSON in and out with a timeout on every call, the one-line
``ServerError``, and the check that a user's url answers and serves the policy.

A url is ``http(s)://host:port`` or ``http+unix://<socket path, percent-encoded>`` (a server
listening on a Unix socket, vLLM's ``--uds``: what otbrl starts on one host — no port to race
for, and only users who may enter the socket's directory can connect); ``unix_url(path)``
makes one.

Retries are the caller's (``ServerRollout``): whether a failed call is retried depends on
whether the server can be restarted.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import socket
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from otbrl.rollout.server_auth import IDENTITY_PATH, TOKEN_ENV, bearer, proof


class ServerError(RuntimeError):
    """A vLLM server failed (did not start, died past its restarts, or answered wrongly); the
    message is one line naming the server. ``status``: the HTTP status it answered with, when
    it answered one (401 / 403: it refused the secret)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


UNIX_SCHEME = "http+unix://"


def unix_url(path: str | Path) -> str:
    """The url of a server listening on the Unix socket ``path``."""
    return UNIX_SCHEME + urllib.parse.quote(str(path), safe="")


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, socket_path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def _unix_request(url: str, data, method: str, headers: dict, timeout: float) -> bytes:
    """One request to a ``http+unix://`` url: the body, or ``ServerError`` on an error status
    (as ``urllib`` would raise ``HTTPError``)."""
    rest = url[len(UNIX_SCHEME) :]
    quoted, slash, path = rest.partition("/")
    connection = _UnixConnection(urllib.parse.unquote(quoted), timeout)
    try:
        connection.request(method, slash + path, body=data, headers=headers)
        response = connection.getresponse()
        raw = response.read()
    finally:
        connection.close()
    if response.status >= 400:
        detail = raw.decode(errors="replace")[:300].replace("\n", " ")
        raise ServerError(f"{url}: HTTP {response.status}: {detail}", response.status)
    return raw


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
    method = method or ("GET" if body is None else "POST")
    all_headers = {"Content-Type": "application/json", **(headers or {}), **bearer(token)}
    if url.startswith(UNIX_SCHEME):
        raw = _unix_request(url, data, method, all_headers, timeout)
        return json.loads(raw) if raw else None
    request = urllib.request.Request(url, data=data, method=method)
    for key, value in all_headers.items():
        request.add_header(key, value)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:300].replace("\n", " ")
        raise ServerError(f"{url}: HTTP {err.code}: {detail}", err.code) from None
    return json.loads(raw) if raw else None


def _refused(url: str, err: ServerError, token: str | None) -> str:
    """What a 401 / 403 from ``url`` means: it answered, and refused this secret (or its
    absence); the fix names the variable, since the config never holds the secret."""
    what = "the secret in OTBRL_SERVER_TOKEN" if token else "a request without a secret"
    status = "HTTP " + str(err).partition(": HTTP ")[2]  # without the route's url again
    return (
        f"{url} answered but refused {what} ({status}): set OTBRL_SERVER_TOKEN to the secret "
        "the server was started with, in the trainer's environment"
    )


def check_identity(url: str, token: str, *, timeout_s: float) -> None:
    """The server at ``url`` proves it holds ``token`` (``otbrl.rollout.server_auth``); else a
    one-line ``ServerError``: another process on its port, a server of another run, or one
    without otbrl's middleware."""
    nonce = secrets.token_hex(16)
    try:
        answer = request_json(
            f"{url.rstrip('/')}{IDENTITY_PATH}?nonce={nonce}", timeout=timeout_s, token=token
        )
    except (OSError, ServerError, ValueError) as err:
        reason = getattr(err, "reason", None) or err
        why = (
            "a server without --middleware otbrl.rollout.server_auth.require_token"
            if getattr(err, "status", None) == 404
            else "another process on its port, or a server started without this run's "
            "OTBRL_SERVER_TOKEN"
        )
        raise ServerError(
            f"{url} does not prove it holds this run's server secret ({reason}): {why}"
        ) from None
    if not isinstance(answer, dict) or answer.get("proof") != proof(token, nonce):
        raise ServerError(f"{url} answered the identity challenge wrongly: not this run's server")


def check_server_url(
    url: str, served_model_name: str, *, key: str, timeout_s: float, token: str | None = None
) -> None:
    """The server at ``url`` answers ``/v1/models`` within ``timeout_s`` and serves
    ``served_model_name`` (and with ``token``, proves it holds it); else a one-line
    ``ServerError`` naming ``key`` and the url: one that answers and refuses the secret is
    told apart from one that does not answer."""
    try:
        models = request_json(f"{url.rstrip('/')}/v1/models", timeout=timeout_s, token=token)
    except ServerError as err:
        if err.status in (401, 403):
            raise ServerError(f"'{key}': {_refused(url, err, token)}", err.status) from None
        raise ServerError(f"'{key}': {url} answered /v1/models with an error ({err})") from None
    except json.JSONDecodeError as err:
        raise ServerError(
            f"'{key}': {url} answered /v1/models with something other than JSON ({err}): "
            "not a vLLM OpenAI server"
        ) from None
    except (OSError, ValueError) as err:
        reason = getattr(err, "reason", None) or err
        raise ServerError(f"'{key}': {url} does not answer ({reason})") from None
    data = models.get("data") if isinstance(models, dict) else None
    names = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
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


def user_server_token() -> str | None:
    """The secret a user's servers (``rollout.server.urls``) were started with: from the
    environment (``OTBRL_SERVER_TOKEN``), never the config, which the run directory keeps."""
    return os.environ.get(TOKEN_ENV) or None


def warn_open_servers(urls: Sequence[str]) -> None:
    """Say that user-started servers without a secret take commands from anyone: their dev
    routes load weights and write files for whoever reaches the port."""
    print(
        f"otbrl: warning: rollout.server.urls {list(urls)} are used without a secret "
        f"({TOKEN_ENV} is not set): anyone who reaches them can load other weights into the "
        "policy's server or pause it. Start each with --middleware "
        f"otbrl.rollout.server_auth.require_token and {TOKEN_ENV}=<secret> in its environment "
        "and the trainer's (docs/rollout.md, Launch recipes).",
        file=sys.stderr,
        flush=True,
    )
