"""``otbrl serve``: a vLLM rollout server for a trainer's ``rollout.server.urls``, started the way
otbrl starts its own (``otbrl.rollout.server_process.server_command``): otbrl's middleware on
every route with a secret (``OTBRL_SERVER_TOKEN``, or a fresh one it prints), its weight-loading
worker extension and dev routes, the CPU memory flags (a KV cache of ``--kv-cache-gib``, not a
share of the host's memory), a context that fits the model; on 127.0.0.1 unless ``--host``
says otherwise. It prints the lines the trainer needs, then serves until Ctrl-C (or SIGTERM),
and stops the server with it.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import sys
import tempfile
import time
from pathlib import Path

from otbrl.cli.common import EXIT_CONFIG
from otbrl.config import ConfigError

# a context otbrl serve gives a model that declares a longer one: the KV cache of a CPU server
# must hold one whole sequence, and the trainer's longest prompt + response is rarely more
DEFAULT_MAX_MODEL_LEN = 4096


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """``otbrl serve``'s arguments."""
    parser.add_argument(
        "model",
        help="a model directory, a hub id in the local HF cache, or a run directory / "
        "checkpoint (its policy; a LoRA checkpoint: its base model, the trainer loads the "
        "adapter's weights at start)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="TCP port (0: a free one)")
    parser.add_argument("--served-model-name", default="policy", help="(policy)")
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help=f"longest prompt + response (default: the model's, at most {DEFAULT_MAX_MODEL_LEN})",
    )
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="CPU KV cache (1.0)")
    parser.add_argument("--dtype", default="float32", help="engine dtype (float32)")
    parser.add_argument("--seed", type=int, default=0, help="(0)")
    parser.add_argument("--log", default=None, help="vLLM's log file (default: a temp file)")
    parser.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds to wait for it (600)"
    )


def served_model(given: str) -> tuple[Path, str]:
    """(the model directory to serve, a note for the user or ""): ``given`` as a model
    directory or a hub id in the cache, or a run directory / checkpoint: its newest verified
    checkpoint's policy (a LoRA checkpoint holds its adapter alone: its base model). A
    ``ConfigError`` naming ``model`` when it is none of them."""
    from otbrl.models import resolve_model_dir
    from otbrl.store.checkpoint import ADAPTER_DIR, resolve_checkpoint

    path = Path(given)
    try:
        if (path / "checkpoint.json").is_file() or (path / "checkpoints").is_dir():
            ckpt = resolve_checkpoint(path)
            if not (ckpt / ADAPTER_DIR).is_dir():
                return ckpt, f"the policy of {ckpt}"
            import yaml

            base = yaml.safe_load((ckpt / "config.yaml").read_text())["model"]["path"]
            note = f"{ckpt} holds a LoRA adapter: serving its base model {base}"
            return resolve_model_dir(base), note
        return resolve_model_dir(given), ""
    except (ValueError, OSError, KeyError, TypeError) as err:
        why = str(err).removeprefix("path: ")
        raise ConfigError(f"'model': {why}", "model") from None


def serve(args: argparse.Namespace) -> int:
    """``otbrl serve``: start the server, print the trainer's lines, serve until stopped."""
    from otbrl.rollout.server_auth import TOKEN_ENV
    from otbrl.rollout.server_process import Server, free_port, server_command
    from otbrl.rollout.vllm_common import check_cpu_head_dim, check_vllm_installed, model_context

    if args.port < 0 or args.port > 65535:
        raise ConfigError(f"'--port': expected 0..65535, got {args.port}", "--port")
    try:
        check_vllm_installed()
    except ImportError as err:
        print(f"otbrl: error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    model_dir, note = served_model(args.model)
    try:  # vLLM's CPU build would start, then fail at the first request
        check_cpu_head_dim(model_dir)
    except ValueError as err:
        raise ConfigError(
            f"'model': {err}: vLLM cannot serve this model on this machine (the trainer's "
            "rollout.name=hf samples any head size)",
            "model",
        ) from None
    declared = model_context(model_dir)
    max_len = args.max_model_len or min(declared or DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_MODEL_LEN)
    port = args.port or free_port()
    given = os.environ.get(TOKEN_ENV)
    token = given or secrets.token_urlsafe(32)
    command, env = server_command(
        model_dir,
        address=(args.host, port),
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        kv_cache_gib=args.kv_cache_gib,
        seed=args.seed,
        max_model_len=max_len,
        token=token,
    )
    log = Path(args.log or Path(tempfile.mkdtemp(prefix="otbrl-serve-")) / "server.log")
    local = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{port}"
    server = Server(local, command, env, log, token)
    try:
        server.start()
        print(
            f"otbrl: starting vLLM for {model_dir} (log {log}); the trainer's lines follow "
            "once it answers (half a minute or more on a CPU)",
            file=sys.stderr,
            flush=True,
        )
        server.wait_ready(args.startup_timeout, model_dir)
        _say_ready(args, model_dir, note, server, port, max_len, given is None)
        while server.alive():
            time.sleep(1.0)
        print(f"otbrl: error: the vLLM server stopped: {server.log_tail()} (log: {log})",
              file=sys.stderr)  # fmt: skip
        return 1
    finally:
        server.close()


def _say_ready(args, model_dir: Path, note: str, server, port: int, max_len: int, fresh: bool):
    """What the trainer needs, on stdout: the secret (when this made it), the urls."""
    from otbrl.rollout.server_auth import TOKEN_ENV

    host = args.host
    if host in ("0.0.0.0", "::"):  # every interface: name the machine, the trainers' way in
        host = socket.getfqdn()
    url = f"http://{host}:{port}"
    where = "reachable from other hosts" if args.host not in ("127.0.0.1", "localhost") else (
        "this machine only"
    )  # fmt: skip
    print(f"otbrl: serving {model_dir} as '{args.served_model_name}' at {url} ({where}; context "
          f"{max_len} tokens; log {server.log}); Ctrl-C stops it", flush=True)  # fmt: skip
    if note:
        print(f"otbrl: {note}", flush=True)
    print("# the trainer's environment and keys (every trainer node):", flush=True)
    if fresh:
        print(f"export {TOKEN_ENV}={server.token}", flush=True)
    else:
        print(f"# {TOKEN_ENV}: the one in this environment, which the server takes", flush=True)
    print(f"rollout.name=vllm rollout.mode=server 'rollout.server.urls=[{url}]' "
          f"rollout.server.served_model_name={args.served_model_name}", flush=True)  # fmt: skip
