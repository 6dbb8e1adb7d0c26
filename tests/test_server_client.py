"""What the trainer says about a user's vLLM server (``rollout.server.urls``) before it trusts
it, against a stand-in HTTP server that guards every route as otbrl's middleware does
(``server_auth.authorized``, the identity proof): no vLLM needed."""

from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from otbrl.rollout.server_auth import IDENTITY_PATH, authorized, proof
from otbrl.rollout.server_client import ServerError, check_server_url

SECRET = "the-servers-secret"
KEY = "rollout.server.urls[0]"


class _Guarded(BaseHTTPRequestHandler):
    """401 unless ``Authorization: Bearer SECRET`` (the middleware's check and text); then
    ``/v1/models`` serves "policy" and the identity route answers its proof. With
    ``middleware = False``, vLLM's ``--api-key`` alone: ``/v1`` guarded, no identity route."""

    middleware = True

    def do_GET(self):
        path, _, query = self.path.partition("?")
        if not authorized(self.headers.get("Authorization"), SECRET):
            return self._send(401, b"unauthorized: this server answers its otbrl run only")
        if path == "/v1/models":
            return self._send(200, json.dumps({"data": [{"id": "policy"}]}).encode())
        if path == IDENTITY_PATH and self.middleware:
            nonce = urllib.parse.parse_qs(query)["nonce"][0]
            return self._send(200, json.dumps({"proof": proof(SECRET, nonce)}).encode())
        return self._send(404, b"not found")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(params=[True, False], ids=["middleware", "api-key-only"])
def guarded_url(request):
    handler = type("Handler", (_Guarded,), {"middleware": request.param})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", request.param
    server.shutdown()
    server.server_close()


def test_a_refused_secret_is_not_a_server_that_does_not_answer(guarded_url):
    """Issue 53: a missing or wrong OTBRL_SERVER_TOKEN said the server "does not answer (...
    HTTP 401 ...)"; it answered and refused the secret, and the fix is the variable."""
    url, middleware = guarded_url
    for token, what in ((None, "a request without a secret"),
                        ("not-the-secret", "the secret in OTBRL_SERVER_TOKEN")):  # fmt: skip
        with pytest.raises(ServerError) as caught:
            check_server_url(url, "policy", key=KEY, timeout_s=10, token=token)
        message = str(caught.value)
        assert "does not answer" not in message, message
        assert message.startswith(f"'{KEY}': {url} answered but refused {what} (HTTP 401"), message
        assert "set OTBRL_SERVER_TOKEN to the secret the server was started with" in message
        assert "\n" not in message and caught.value.status == 401
    if middleware:  # the right secret: served, and the identity proven
        check_server_url(url, "policy", key=KEY, timeout_s=10, token=SECRET)
    else:  # vLLM's --api-key guards /v1 only: the identity route is missing, and said so
        with pytest.raises(ServerError, match=r"does not prove it holds .*HTTP 404.*--middleware"):
            check_server_url(url, "policy", key=KEY, timeout_s=10, token=SECRET)


def test_a_url_that_serves_something_else_says_so():
    """A web server that is not vLLM's (HTML on /v1/models) "did not answer" before."""

    class Page(_Guarded):
        def do_GET(self):
            self._send(200, b"<html>a dashboard</html>")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(ServerError, match=r"something other than JSON .*not a vLLM"):
            check_server_url(url, "policy", key=KEY, timeout_s=10)
    finally:
        server.shutdown()
        server.server_close()
