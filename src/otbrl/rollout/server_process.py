"""The vLLM servers otbrl starts itself (``rollout.mode=server`` without ``urls``): the command
line, a Unix socket each, one process each (start, alive, stop, its log's last error), and the
wait until it answers.

- Each listens on a Unix socket (vLLM's ``--uds``) in a directory only this user may enter
  (``mkdtemp``: made atomically, mode 0700), not on a TCP port: there is no port to pick and
  then bind, so no window in which another process can take it, and other users of the host
  cannot connect at all (every route also asks for the secret: ``server_auth``).

- Start-up: ``python -m vllm.entrypoints.openai.api_server`` (the CPU build's ``vllm`` console
  script fails on a package-name lookup) with ``VLLM_SERVER_DEV_MODE=1`` (the dev endpoints
  ``ServerRollout`` uses), ``--served-model-name`` (what ``urls`` are checked against),
  ``--generation-config vllm`` (no EOS of the model's generation config added to our stops),
  ``--logprobs-mode processed_logprobs`` and on CPU no chunked prefill — the in-process
  backend's settings (``otbrl.rollout.vllm``), for the same log-probs and seeded draws.
- Each server runs in a session of its own, so stopping it takes its engine-core child along.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from otbrl.children import die_with_parent
from otbrl.quiet import quiet_vllm, user_env
from otbrl.rollout.server_auth import TOKEN_ENV
from otbrl.rollout.server_client import ServerError, check_identity, request_json, unix_url
from otbrl.rollout.vllm_common import CPU_STEP_TOKENS, check_vllm_installed

WORKER_EXTENSION = "otbrl.rollout.server_worker.WeightLoader"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(
    model_dir: Path,
    *,
    socket_path: Path | None = None,
    address: tuple[str, int] | None = None,
    served_model_name: str,
    dtype: str,
    kv_cache_gib: float,
    seed: int,
    max_model_len: int | None,
    token: str,
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one server listening on the Unix socket
    ``socket_path`` (otbrl's own servers) or on ``address`` (host, port: ``otbrl serve``), whose
    every route asks for ``token`` (``otbrl.rollout.server_auth``)."""
    if (socket_path is None) == (address is None):
        raise ValueError("socket_path, address: expected exactly one of them")
    listen = ["--uds", str(socket_path)] if address is None else [
        "--host", address[0], "--port", str(address[1])
    ]  # fmt: skip
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", served_model_name,
        "--dtype", dtype, "--enforce-eager", *listen,
        "--seed", str(seed), "--generation-config", "vllm",
        "--logprobs-mode", "processed_logprobs", "--skip-tokenizer-init",
        "--worker-extension-cls", WORKER_EXTENSION,
        "--middleware", "otbrl.rollout.server_auth.require_token",
    ]  # fmt: skip
    if max_model_len:
        command += ["--max-model-len", str(max_model_len)]
    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # the dev routes: behind the middleware's secret
    env[TOKEN_ENV] = token
    # a server's log keeps vLLM's warnings, unless the user set a level (not quiet_vllm)
    env["VLLM_LOGGING_LEVEL"] = user_env("VLLM_LOGGING_LEVEL") or "WARNING"
    # the worker extension must import otbrl from this very checkout
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    quiet_vllm()  # this process's own first vLLM import may be this one
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        command += [
            "--kv-cache-memory-bytes", str(int(kv_cache_gib * 2**30)),
            "--no-enable-chunked-prefill",
            "--max-num-batched-tokens", str(max(CPU_STEP_TOKENS, max_model_len or 0)),
        ]  # fmt: skip
    return command, env


class Server:
    """One server: its url, the secret its every route asks for (``token``; None for a user's
    server started without one), and the process when otbrl started it (``command``)."""

    def __init__(
        self,
        url: str,
        command: list[str] | None,
        env: dict | None,
        log: Path | None,
        token: str | None = None,
        socket_path: Path | None = None,
    ):
        self.url, self.command, self.env, self.log = url.rstrip("/"), command, env, log
        self.token = token
        self.socket_path = socket_path  # a server otbrl started: where it listens
        self.process: subprocess.Popen | None = None
        self.restarts = 0

    def call(self, path: str, body: dict | None = None, *, timeout: float, headers=None):
        """``request_json`` on ``url + path`` with this server's secret."""
        return request_json(
            f"{self.url}{path}", body, timeout=timeout, headers=headers, token=self.token
        )

    @property
    def owned(self) -> bool:
        return self.command is not None

    def start(self) -> None:
        if self.socket_path is not None:  # a restart: the dead server's socket is in the way
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                self.command,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its engine-core child goes with it on stop()
                # and with the trainer if that is killed (SIGTERM: vLLM stops its engine core)
                preexec_fn=die_with_parent(signal.SIGTERM),
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
        if self.socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()

    def close(self) -> None:
        """Stop it for good: its socket's directory goes too once its last server closed
        (``stop`` keeps it for a restart: a directory made again could be someone else's)."""
        self.stop()
        if self.socket_path is not None:
            with contextlib.suppress(OSError):
                self.socket_path.parent.rmdir()

    def log_tail(self) -> str:
        """The server's last error line, for a one-line message."""
        if self.log is None or not self.log.exists():
            return ""
        lines = [ln.strip() for ln in self.log.read_text(errors="replace").splitlines()]
        errors = [ln for ln in lines if "Error" in ln or "error" in ln]
        return (errors or lines or [""])[-1][-300:]

    def wait_ready(self, timeout_s: float, model_dir: Path) -> None:
        """Until ``/health`` answers; a ``ServerError`` (the server stopped) when the process
        exits first or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServerError(
                    f"vLLM server {self.url} (model {model_dir}) exited during start-up: "
                    f"{self.log_tail() or 'no output'} (log: {self.log})"
                )
            try:
                self.call("/health", timeout=5)
            except (OSError, ServerError, ValueError):
                time.sleep(0.5)
                continue
            if self.token:  # the server that answers is ours, not a squatter on its port
                try:
                    check_identity(self.url, self.token, timeout_s=10)
                except ServerError:
                    self.stop()
                    raise
            return
        self.stop()
        raise ServerError(
            f"vLLM server {self.url} (model {model_dir}) did not answer within "
            f"{timeout_s:.0f} s (log: {self.log})"
        )


def start_servers(
    model_dir: Path,
    count: int,
    *,
    seed: int,
    startup_timeout_s: float,
    log_dir: str | os.PathLike | None,
    **settings,
) -> list[Server]:
    """``count`` servers on Unix sockets of a private directory (server i seeded ``seed + i``,
    its log ``<log_dir>/server-<i>.log``; None: a fresh temporary directory), started together,
    each answering; ``settings``: the rest of :func:`server_command`'s. On failure the ones started
    are stopped."""
    check_vllm_installed()
    logs = Path(log_dir or tempfile.mkdtemp(prefix="otbrl-servers-"))
    logs.mkdir(parents=True, exist_ok=True)  # a run's <output_dir>/servers is new
    # short (a socket path has at most 107 bytes), private, made atomically
    sockets = Path(tempfile.mkdtemp(prefix="otbrl-vllm-"))
    servers: list[Server] = []
    try:
        for i in range(count):
            socket_path = sockets / f"server-{i}.sock"
            # the run's secret when the user set one (their trainers and tools share it), else
            # a fresh one per server: a log that leaks one opens one server only
            token = os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(32)
            command, env = server_command(
                model_dir, socket_path=socket_path, seed=seed + i, token=token, **settings
            )
            log = logs / f"server-{i}.log"
            servers.append(Server(unix_url(socket_path), command, env, log, token, socket_path))
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(startup_timeout_s, model_dir)
    except BaseException:
        for server in servers:
            server.close()
        with contextlib.suppress(OSError):
            sockets.rmdir()
        raise
    return servers
