"""The parallel layout of a run, owned in one place.

``ParallelDims`` is built once, from the ``actor`` settings and the number of processes, before
any model loads; it validates itself and is asked every layout question afterwards — which
strategy (one process, FSDP2, tensor parallel), the data-parallel size, whether a process group is
needed, how a batch splits over ranks, the device mesh. A new parallel mode is a field here, a
check in ``__post_init__`` and a branch in ``engine.parallel.parallelize``.
"""

from __future__ import annotations

from dataclasses import dataclass

from otbrl.errors import ConfigError

STRATEGIES = ("auto", "single", "fsdp", "tp")
# field -> the config key that sets it (errors name the key a user can change)
KEYS = {
    "strategy": "actor.strategy",
    "tp": "actor.tensor_parallel_size",
    "sp": "actor.ulysses_sequence_parallel_size",
    "fused": "actor.use_fused_kernels",
}


@dataclass(frozen=True)
class ParallelDims:
    """How the job's ``world_size`` processes split the work.

    ``strategy`` is asked as ``auto | single | fsdp | tp`` and resolved on construction (``auto``:
    ``tp`` when ``tp > 1``, FSDP2 when there are several processes or ``sp > 1``, else one
    process). ``tp``: tensor-parallel degree; ``sp``: Ulysses sequence-parallel degree; the rest
    is data parallel (``dp = world_size / (tp · sp)``). ``fused``: the fused lm_head statistics
    (one process only). Invalid combinations raise ``ConfigError`` naming the ``actor`` key.
    """

    world_size: int = 1
    tp: int = 1
    sp: int = 1
    strategy: str = "auto"
    fused: bool = False

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "sp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                key = KEYS.get(name, name)
                raise ConfigError(f"'{key}' must be an int >= 1, got {value!r}", key)
        if self.strategy not in STRATEGIES:
            raise ConfigError(
                f"'actor.strategy' must be one of {list(STRATEGIES)}, got {self.strategy!r}",
                "actor.strategy",
            )
        object.__setattr__(self, "strategy", self._resolve())
        self._check()

    def _resolve(self) -> str:
        if self.strategy != "auto":
            return self.strategy
        if self.tp > 1:
            return "tp"
        return "fsdp" if self.world_size > 1 or self.sp > 1 else "single"

    def _check(self) -> None:
        tp, sp, world, strategy = self.tp, self.sp, self.world_size, self.strategy
        if strategy == "single" and world > 1:
            raise ConfigError(
                f"'actor.strategy' is 'single' but torchrun started {world} processes; use "
                "actor.strategy=auto (FSDP2), fsdp or tp",
                "actor.strategy",
            )
        if strategy == "tp" and tp < 2:
            raise ConfigError(
                "'actor.tensor_parallel_size' must be > 1 with actor.strategy=tp", KEYS["tp"]
            )
        if strategy != "tp" and tp > 1:
            raise ConfigError(
                "'actor.tensor_parallel_size' > 1 needs actor.strategy=tp (or auto)", KEYS["tp"]
            )
        if strategy == "single" and sp > 1:
            raise ConfigError(
                "'actor.ulysses_sequence_parallel_size' > 1 needs a sharded strategy "
                "(auto or fsdp)",
                KEYS["sp"],
            )
        if tp > 1 and sp > 1:
            raise ConfigError(
                "'actor.ulysses_sequence_parallel_size' > 1 cannot be combined with tensor "
                "parallel",
                KEYS["sp"],
            )
        if world % (tp * sp):
            raise ConfigError(
                f"'actor.tensor_parallel_size' x 'actor.ulysses_sequence_parallel_size' "
                f"({tp * sp}) must divide the number of processes ({world})",
                KEYS["tp"],
            )
        if strategy != "single" and self.fused:
            raise ConfigError(
                "'actor.use_fused_kernels' is supported by the single-process strategy only",
                KEYS["fused"],
            )

    @property
    def dp(self) -> int:
        """Data-parallel size: the number of ranks that see different prompts."""
        return self.world_size // (self.tp * self.sp)

    @property
    def distributed(self) -> bool:
        """A process group is needed: several processes, or a sharded strategy asked for."""
        return self.world_size > 1 or self.strategy != "single"

    def check_divisible(self, key: str, prompts: int) -> None:
        """``prompts`` (the value of config ``key``) split evenly over the data-parallel ranks:
        every rank trains whole groups, so a group-relative estimator needs no communication."""
        if prompts % self.dp:
            raise ConfigError(
                f"'{key}' ({prompts} prompts) must be divisible by the data-parallel size "
                f"{self.dp}",
                key,
            )

    def mesh_shape(self) -> tuple[int, int, int]:
        """``(dp, sp, tp)``: the shape of the ("dp", "sp", "tp") device mesh."""
        return self.dp, self.sp, self.tp
