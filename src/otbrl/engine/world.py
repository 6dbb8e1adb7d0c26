"""Who this process is in the job: process-group setup and the ``World`` the loop talks to.

One process per device, launched by `torchrun` (which sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) or spawned by a test with an explicit `tcp://` init method.
Backend: gloo on CPU, NCCL on CUDA. Every collective carries a timeout, so a rank that dies
makes the survivors fail with `DistributedError` in bounded time instead of hanging.

``World`` is what the training loop sees of parallelism (torchtitan's ``ParallelDims`` in
miniature): this data-parallel rank's share of the prompts, the reduction of metrics over
ranks, and which rank writes files. At world size 1 it is the identity and needs no process
group, so one loop serves every world size.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from otbrl.engine.dims import ParallelDims
from otbrl.engine.parallel import build_mesh

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 300.0


class DistributedError(RuntimeError):
    """A collective failed or timed out: a peer rank most likely died or stalled."""


class DistInfo(NamedTuple):
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def _env_int(name: str, default: int | None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise ValueError(
                f"environment variable {name}: expected an integer set by torchrun, got nothing"
            )
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}: expected an integer, got {raw!r}") from None


def init_distributed(
    *,
    backend: str | None = None,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> DistInfo:
    """Join (or create) the default process group and pick this process's device.

    Unset arguments come from the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK; a
    single process without them is rank 0 of 1). `backend=None` picks NCCL when CUDA is
    available, gloo otherwise. `timeout_s` bounds every collective: the survivors of a dead
    rank get an error after at most that long (gloo usually fails sooner, when the peer's
    socket closes). Idempotent: if the group exists, its settings are returned.
    """
    if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
    if backend is not None and backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: expected 'gloo', 'nccl' or None, got {backend!r}")
    rank = _env_int("RANK", 0) if rank is None else rank
    world_size = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
    local_rank = _env_int("LOCAL_RANK", rank) if local_rank is None else local_rank
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("backend: 'nccl' needs CUDA, which is not available; use 'gloo'")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if dist.is_initialized():
        return DistInfo(
            dist.get_rank(), dist.get_world_size(), local_rank, device, dist.get_backend()
        )
    if init_method is None and "MASTER_ADDR" not in os.environ:
        if world_size != 1:
            raise ValueError(
                "init_method: expected a tcp:// address or MASTER_ADDR/MASTER_PORT from torchrun "
                f"for world_size={world_size}, got neither"
            )
        # A single process still gets a (trivial) group so one code path serves every size.
        init_method = "tcp://127.0.0.1:" + str(free_port())
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if backend == "nccl" else None,
    )
    return DistInfo(rank, world_size, local_rank, device, backend)


def teardown_distributed() -> None:
    """Destroy the default process group if one exists (safe to call twice)."""
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def collective_guard(what: str) -> Iterator[None]:
    """Re-raise a failed collective inside the block as `DistributedError` naming `what`.

    Gloo and NCCL report a dead peer as a bare RuntimeError ("Connection closed by peer",
    "Timed out waiting ..."); this names the step, this rank and the likely cause.
    """
    try:
        yield
    except DistributedError:
        raise
    except RuntimeError as err:
        # our own errors (a reward failing or timing out, weights gone non-finite) subclass
        # RuntimeError and may mention a timeout: only torch's own errors are candidates
        if type(err) is not RuntimeError and not isinstance(err, dist.DistError):
            raise
        text = str(err)
        markers = ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "socket")
        if not any(m in text.lower() for m in markers):
            raise
        rank = dist.get_rank() if dist.is_initialized() else -1
        raise DistributedError(
            f"rank {rank}: a collective failed during {what}; another rank probably died or "
            f"stalled (cause: {text.splitlines()[0] if text else type(err).__name__})"
        ) from err


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (for tests and single-process runs)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class World:
    """This process's place in the job; the identity at world size 1.

    ``mesh`` is the ("dp", "sp", "tp") device mesh of a multi-process run (None in one process
    without a process group). Ranks of one SP/TP group hold the same data, so sharding and
    metric reduction follow the data-parallel dimension.
    """

    rank: int = 0
    size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: DeviceMesh | None = None

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that prints and writes the run directory."""
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return 0 if self.mesh is None else self.mesh["dp"].get_local_rank()

    @property
    def dp_size(self) -> int:
        return 1 if self.mesh is None else self.mesh["dp"].size()

    def shard(self, items: Sequence[T], *, even: bool = True) -> list[T]:
        """This data-parallel rank's contiguous share of ``items`` (all of them at dp = 1): the
        one sharding rule of training and evaluation. ``even=True``: ``len(items)`` must be a
        multiple of the data-parallel size (every rank trains whole groups, the same number);
        ``even=False``: the first ``len(items) % dp`` ranks take one item more (some may get
        none)."""
        n, dp = len(items), self.dp_size
        if even and n % dp:
            raise ValueError(f"items: expected a multiple of the data-parallel size {dp}, got {n}")
        share, extra = divmod(n, dp)
        start = self.dp_rank * share + min(self.dp_rank, extra)
        return list(items[start : start + share + (self.dp_rank < extra)])

    def sum(self, values: Sequence[float], *, over: str = "world") -> list[float]:
        """Element-wise float64 sum over every rank (``over="world"``) or over the
        data-parallel group (``over="dp"``: SP/TP peers hold the same data); the values
        themselves when there is nobody to sum with."""
        if over not in ("world", "dp"):
            raise ValueError(f"over: expected 'world' or 'dp', got {over!r}")
        if over == "dp" and self.dp_size == 1:
            return [float(v) for v in values]
        group = self.mesh["dp"].get_group() if over == "dp" and self.mesh is not None else None
        return self._all_reduce(values, dist.ReduceOp.SUM, group)

    def max(self, values: Sequence[float]) -> list[float]:
        """Element-wise largest value over every rank; the values themselves on one process."""
        return self._all_reduce(values, dist.ReduceOp.MAX, None)

    def _all_reduce(self, values: Sequence[float], op, group) -> list[float]:
        if self.mesh is None:
            return [float(v) for v in values]
        tally = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(tally, op=op, group=group)
        return tally.tolist()

    def mean_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Metrics reduced over the ranks that report them: averaged, except ``throughput/*``
        (summed), ``memory/*`` (the largest rank's: the one that runs out first) and maxima /
        minima (keys ending in ``_max``, ``/max``, ``_min``, ``/min``: the extreme over
        ranks)."""
        if self.mesh is None:
            return dict(metrics)
        gathered: list[dict] = [{} for _ in range(self.size)]
        dist.all_gather_object(gathered, metrics)
        out = {}
        for key in metrics:
            values = [float(g[key]) for g in gathered if key in g]
            if key.startswith("throughput/"):
                out[key] = sum(values)
            elif key.startswith("memory/") or key.endswith(("_max", "/max")):
                out[key] = max(values)
            elif key.endswith(("_min", "/min")):
                out[key] = min(values)
            else:
                out[key] = sum(values) / len(values)
        return out

    def broadcast_object(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank (picklable values: this travels between this job's
        own processes, never from a file); ``obj`` itself at world size 1."""
        if self.mesh is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        """Wait for every rank (nothing to wait for at world size 1)."""
        if self.mesh is not None:
            dist.barrier()


def local_world() -> World:
    """The world of one process: this machine's GPU when it has one (``cuda:<current>``),
    else the CPU; no process group."""
    if torch.cuda.is_available():
        return World(device=torch.device("cuda", torch.cuda.current_device()))
    return World()


def start_world(dims: ParallelDims, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> World:
    """The ``World`` of this process: a process group and a ``dims``-shaped mesh when
    ``dims.distributed`` (torchrun, or a sharded engine asked for explicitly), else the identity
    world without one (``local_world``). torchrun's world size must be the one ``dims`` was
    planned for."""
    if not dims.distributed:
        return local_world()
    info = init_distributed(timeout_s=timeout_s)
    if info.world_size != dims.world_size:
        raise RuntimeError(
            f"dims: planned for {dims.world_size} processes, torchrun started {info.world_size}"
        )
    mesh = build_mesh(info.world_size, sp=dims.sp, tp=dims.tp, device_type=info.device.type)
    return World(rank=info.rank, size=info.world_size, device=info.device, mesh=mesh)
