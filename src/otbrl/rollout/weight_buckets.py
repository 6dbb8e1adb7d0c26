"""Weights as safetensors buckets: the trainer writes them into a directory of its own
(``ServerRollout.sync_weights``) with a manifest (each bucket's name, size, SHA-256 and tensor
count), and the servers' worker extension (``otbrl.rollout.server_worker``) streams them back in
the order they were written — read from that directory when the servers see it (``file``:
``/dev/shm`` on one machine, a shared file system across hosts), or fetched from the trainer's
``WeightServer`` over HTTP (``http``: no shared file system) — checking every bucket against the
manifest before a tensor of it loads. The bucket format and its checks live here alone.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import shutil
import tempfile
import threading
import urllib.request
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING

from otbrl.rollout.server_auth import authorized, bearer

if TYPE_CHECKING:
    from otbrl.rollout.config import ServerConfig

BUCKET_GLOB = "bucket-*.safetensors"


def scratch_dir() -> Path:
    """A fresh directory for buckets: in ``/dev/shm`` (memory, no disk write) when it is
    writable, else in the system temp dir."""
    shm = Path("/dev/shm")
    root = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="otbrl-weights-", dir=root))


def write_buckets(directory: Path, named_tensors: Iterable, bucket_bytes: int) -> list[dict]:
    """Replace the buckets of ``directory`` with ``named_tensors`` ((HF name, tensor) pairs),
    ~``bucket_bytes`` a bucket. One bucket is in memory at a time (never a second full copy
    of the model); each file appears whole (written, then renamed). Returns the manifest: per
    bucket, in order, ``{"name", "bytes", "sha256", "tensors"}``. A bucket the directory's
    file system has no room for is an ``OSError`` (ENOSPC) that says how much was free and what
    to change, raised before a byte of it is written (``/dev/shm`` is small in containers)."""
    from safetensors.torch import save
    from torch import Tensor

    for old in bucket_files(directory):
        old.unlink()
    bucket: dict[str, Tensor] = {}
    size, index = 0, 0
    manifest: list[dict] = []

    def flush():
        nonlocal bucket, size, index
        if bucket:
            path = directory / f"bucket-{index:05d}.safetensors"
            tmp = path.with_suffix(".tmp")
            data = save(bucket)
            free = shutil.disk_usage(directory).free
            if free < len(data):
                raise OSError(
                    errno.ENOSPC,
                    f"weight buckets: {directory} has {free / 2**20:.1f} MiB free, the next "
                    f"bucket needs {len(data) / 2**20:.1f} MiB (the policy needs at least "
                    "its size in weights there): free space, enlarge it (a container's /dev/shm: "
                    "--shm-size) or set rollout.server.weights_dir to a larger file system",
                )
            tmp.write_bytes(data)
            tmp.rename(path)
            digest = hashlib.sha256(data).hexdigest()
            entry = {"name": path.name, "bytes": len(data), "sha256": digest}
            manifest.append({**entry, "tensors": len(bucket)})
            index += 1
        bucket, size = {}, 0

    for name, tensor in named_tensors:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"named_tensors: {name!r} is a {type(tensor).__name__}")
        bucket[name] = tensor.detach().contiguous().cpu()
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            flush()
    flush()
    return manifest


def bucket_files(directory: str | Path) -> list[Path]:
    """The weight buckets of ``directory`` in the order they were written (by name)."""
    return sorted(Path(directory).glob(BUCKET_GLOB))


def checked_buckets(manifest: list[dict], read, source: str):
    """(HF name, tensor) of every bucket of ``manifest``, in order, one bucket in memory at a
    time: ``read(entry) -> bytes`` gets a bucket (from the directory, or over HTTP); a bucket
    whose size, SHA-256 or tensor count differs from its entry is a ``ValueError`` naming
    ``source`` and the bucket, raised before any tensor of it is handed on."""
    from safetensors.torch import load

    for entry in manifest:
        data = read(entry)
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != entry["bytes"] or not hmac.compare_digest(digest, entry["sha256"]):
            raise ValueError(
                f"{source}: weight bucket {entry['name']} is not the one the trainer wrote "
                f"({len(data)} bytes, sha256 {digest[:12]}…; expected {entry['bytes']} bytes, "
                f"{entry['sha256'][:12]}…)"
            )
        tensors = load(data)
        if len(tensors) != entry["tensors"]:
            raise ValueError(
                f"{source}: weight bucket {entry['name']} holds {len(tensors)} tensors, the "
                f"manifest {entry['tensors']}"
            )
        yield from tensors.items()


def read_file(directory: str | Path):
    """``checked_buckets``' reader of the buckets in ``directory``."""
    return lambda entry: (Path(directory) / entry["name"]).read_bytes()


def read_http(url: str, token: str, timeout: float = 300.0):
    """``checked_buckets``' reader of the buckets a ``WeightServer`` at ``url`` serves."""

    def read(entry: dict) -> bytes:
        request = urllib.request.Request(f"{url}/{entry['name']}", headers=bearer(token))
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read()

    return read


class WeightServer:
    """The trainer's buckets over HTTP for servers that do not share its file system: ``GET
    /<bucket name>`` with ``Authorization: Bearer <token>`` (a fresh random token per run; a
    request without it is refused, 401) serves that bucket of ``directory``; nothing else is
    served. Binds ``host`` (the address the servers reach the trainer at) on a free port;
    ``url`` is where it listens. Plain HTTP: on a network others can read, tunnel it."""

    def __init__(self, directory: Path, host: str = "127.0.0.1") -> None:
        import secrets

        self.directory = Path(directory)
        self.token = secrets.token_urlsafe(32)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if not authorized(self.headers.get("Authorization"), server.token):
                    self.send_error(401, "a weight bucket needs the run's token")
                    return
                name = self.path.lstrip("/")
                path = server.directory / name
                if "/" in name or not path.match(BUCKET_GLOB) or not path.is_file():
                    self.send_error(404, "no such weight bucket")
                    return
                data = path.read_bytes()
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # the run's log is not for access lines
                pass

        self._httpd = ThreadingHTTPServer((host, 0), Handler)
        self._httpd.daemon_threads = True
        bound = self._httpd.server_address
        self.url = f"http://{host}:{bound[1]}"
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="otbrl-weights", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._httpd.server_close()


def weight_transport(settings: ServerConfig) -> str:
    """``rollout.server.weight_transport`` resolved: ``auto`` is ``http`` for servers the user
    started (``urls``: maybe on other hosts, which cannot see the trainer's ``/dev/shm``) when
    no shared ``weights_dir`` is given, else ``file``."""
    if settings.weight_transport != "auto":
        return settings.weight_transport
    return "http" if settings.urls and settings.weights_dir is None else "file"
