"""The RL loop under torchrun: ``Trainer`` with a sharded engine, one process per device.

    torchrun --nproc_per_node=2 -m otbrl train actor.engine=fsdp
    torchrun --nproc_per_node=4 -m otbrl train actor.engine=tp actor.tensor_parallel_size=2

What changes from the single-process loop, and nothing else:

- the engine is a ``ShardedActor`` (FSDP2, TP, Ulysses; ``otbrl.engine.distributed``);
- rollout: every rank draws the same prompt batch (same data seed) and each data-parallel rank
  generates for its contiguous share of prompts, with the unsharded ``inference_model`` that
  the engine refreshes after every update (the weight-sync pattern a vLLM rollout will use);
  ranks of one TP/SP group generate the same share, so they hold identical batches;
- groups stay whole: all ``rollout.n`` responses of a prompt are generated and trained on the
  rank that owns the prompt, so group-relative estimators (GRPO, RLOO, OTB) compute exactly the
  single-process advantages locally, without gathering rewards or Σπ² first;
- metrics are averaged over ranks (throughput summed); only rank 0 prints and writes the run
  directory (other ranks write theirs under ``<output_dir>/rank<r>``);
- checkpoints: model + optimizer shards with torch.distributed.checkpoint under
  ``checkpoints/sharded/step_<k>`` (readable by any world size), then rank 0 publishes the usual
  ``checkpoints/step_<k>`` (HF weights of the rollout copy, tokenizer, scheduler, trainer state),
  so ``otbrl export`` works unchanged and a step directory exists only once its shards do.
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from otbrl import checkpoint
from otbrl.config import Config, ConfigError, to_dict
from otbrl.data import encode_prompts
from otbrl.engine.dist import collective_guard, init_distributed
from otbrl.engine.distributed import ShardedActor, load_sharded_state, save_sharded_state
from otbrl.engine.parallel import build_mesh
from otbrl.rollout import generate
from otbrl.sft import evaluate_accuracy
from otbrl.trainer import Trainer, warm_start

SHARDED_DIR = "sharded"


def check_parallel_config(cfg: Config, world_size: int) -> None:
    """Raise ``ConfigError`` naming the key when the layout does not fit `world_size`."""
    a = cfg.actor
    tp, sp = a.tensor_parallel_size, a.ulysses_sequence_parallel_size
    if a.engine == "tp" and tp < 2:
        raise ConfigError(
            "'actor.tensor_parallel_size' must be > 1 with actor.engine=tp",
            "actor.tensor_parallel_size",
        )
    if a.engine == "fsdp" and tp > 1:
        raise ConfigError(
            "'actor.tensor_parallel_size' > 1 needs actor.engine=tp", "actor.tensor_parallel_size"
        )
    if tp > 1 and sp > 1:
        raise ConfigError(
            "'actor.ulysses_sequence_parallel_size' > 1 cannot be combined with tensor parallel",
            "actor.ulysses_sequence_parallel_size",
        )
    if world_size % (tp * sp):
        raise ConfigError(
            f"'actor.tensor_parallel_size' x 'actor.ulysses_sequence_parallel_size' ({tp * sp}) "
            f"must divide the number of processes ({world_size})",
            "actor.tensor_parallel_size",
        )
    if getattr(cfg.trainer, "max_wall_seconds", 0) > 0:
        # each rank would read its own clock and the ranks could stop at different steps
        raise ConfigError(
            "'trainer.max_wall_seconds' is not supported by the distributed engines; use "
            "trainer.total_steps",
            "trainer.max_wall_seconds",
        )
    dp = world_size // (tp * sp)
    for key, value in (
        ("data.train_batch_size", cfg.data.train_batch_size),
        ("actor.ppo_mini_batch_size", a.ppo_mini_batch_size),
    ):
        if value % dp:
            raise ConfigError(
                f"'{key}' ({value} prompts) must be divisible by the data-parallel size {dp}", key
            )
    local = a.ppo_mini_batch_size * cfg.rollout.n // dp
    if local % a.micro_batch_size:
        raise ConfigError(
            f"'actor.micro_batch_size' ({a.micro_batch_size}) must divide each rank's share of a "
            f"mini-batch ({local} sequences = ppo_mini_batch_size x rollout.n / {dp} ranks)",
            "actor.micro_batch_size",
        )


class DistributedTrainer(Trainer):
    """``Trainer`` for ``actor.engine`` in (fsdp, tp); every process of the job constructs one."""

    def __init__(self, cfg: Config):
        self.info = init_distributed()
        check_parallel_config(cfg, self.info.world_size)
        a = cfg.actor
        self.mesh = build_mesh(
            self.info.world_size,
            sp=a.ulysses_sequence_parallel_size,
            tp=a.tensor_parallel_size,
            device_type=self.info.device.type,
        )
        self.dp_rank, self.dp_size = self.mesh["dp"].get_local_rank(), self.mesh["dp"].size()
        self.is_main = self.info.rank == 0
        if cfg.model.path == "builtin":
            # one rank trains (or finds) the cached warm start; the others then read it
            if self.is_main:
                warm_start(cfg)
            dist.barrier()
        run_dir = Path(cfg.trainer.output_dir)
        if not self.is_main:
            cfg = copy.deepcopy(cfg)
            cfg.trainer.output_dir = str(run_dir / f"rank{self.info.rank}")
            cfg.trainer.logger = ["jsonl"]
        super().__init__(cfg)
        self.ckpt_root = run_dir / "checkpoints"

    def build_actor(self, ref_model) -> ShardedActor:
        cfg = self.cfg
        device = self.info.device
        self.model.to(device)
        if ref_model is not None:
            ref_model.to(device)
        return ShardedActor(
            self.model,
            cfg.actor,
            mesh=self.mesh,
            engine=cfg.actor.engine,
            ppo_mini_batch_size=cfg.actor.ppo_mini_batch_size * cfg.rollout.n,
            temperature=cfg.rollout.temperature,
            use_remove_padding=cfg.model.use_remove_padding,
            ref_model=ref_model,
            seed=cfg.trainer.seed,
            device=device,
        )

    # -- one step -------------------------------------------------------------------------------
    def rollout(self) -> tuple[dict[str, Tensor], list[dict]]:
        """This DP rank's share of the prompts, n responses each, from the rollout copy."""
        cfg = self.cfg
        rows = self.dataset.next_batch()  # identical on every rank
        share = len(rows) // self.dp_size
        rows = rows[self.dp_rank * share : (self.dp_rank + 1) * share]
        enc = encode_prompts(rows, self.tokenizer, cfg.data.max_prompt_length)
        device = self.info.device
        n = cfg.rollout.n
        out = generate(
            self.actor.inference_model,
            self.tokenizer,
            enc["input_ids"].to(device),
            enc["attention_mask"].to(device),
            n=n,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            do_sample=True,
            seed=(cfg.trainer.seed * 1_000_003 + self.step) * 7919 + self.dp_rank,
        )
        batch = {k: v.cpu() if isinstance(v, Tensor) else v for k, v in dict(out).items()}
        batch["uid"] = batch["uid"] + self.dp_rank * share  # global prompt index
        return batch, [row for row in rows for _ in range(n)]

    def train_step(self) -> dict[str, float]:
        """One RL step on every rank; metrics averaged over ranks (throughput summed)."""
        with collective_guard(f"training step {self.step}"):
            metrics = super().train_step()
            return self._reduce(metrics)

    def _reduce(self, metrics: dict[str, float]) -> dict[str, float]:
        gathered: list[dict] = [None] * self.info.world_size  # type: ignore[list-item]
        dist.all_gather_object(gathered, metrics)
        out = {}
        for key in metrics:
            values = [g[key] for g in gathered if key in g]
            total = sum(float(v) for v in values)
            out[key] = total if key.startswith("throughput/") else total / len(values)
        return out

    def validate(self) -> float:
        """Accuracy over all validation rows, each rank scoring its share with the rollout copy."""
        cfg = self.cfg
        rank, size = self.info.rank, self.info.world_size
        rows = self.val_rows[rank::size]
        accuracy = 0.0
        if rows:
            accuracy = evaluate_accuracy(
                self.actor.inference_model,
                self.tokenizer,
                rows,
                max_new_tokens=cfg.rollout.max_new_tokens,
                greedy=cfg.trainer.val_greedy,
                temperature=cfg.trainer.val_temperature,
                batch_size=cfg.trainer.val_batch_size,
                seed=cfg.trainer.seed + self.step,
                function=self.reward_fn,
            )
        tally = torch.tensor(
            [accuracy * len(rows), float(len(rows))], dtype=torch.float64, device=self.info.device
        )
        dist.all_reduce(tally)
        return float(tally[0] / tally[1].clamp(min=1.0))

    # -- checkpoints -----------------------------------------------------------------------------
    def _save(self) -> None:
        name = f"step_{self.step}"
        sharded_root = self.ckpt_root / SHARDED_DIR
        tmp, final = sharded_root / f".tmp-{name}", sharded_root / name
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        save_sharded_state(self.actor, tmp)
        dist.barrier()
        if self.is_main:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            state = {**self._trainer_state(), "world_size": self.info.world_size}
            checkpoint.save_checkpoint(
                self.ckpt_root,
                self.step,
                model=self.actor.inference_model,
                tokenizer=self.tokenizer,
                scheduler=self.actor.scheduler,
                trainer_state=state,
                config=to_dict(self.cfg),
            )
        dist.barrier()

    def _resume(self) -> None:
        path = self._resume_path()
        if path is None:
            return
        sharded = path.parent / SHARDED_DIR / path.name
        if not (sharded / ".metadata").is_file():
            raise ConfigError(
                f"'trainer.resume': {path} has no sharded state at {sharded} (was it written by "
                "the single-process engine? resume it with actor.engine=single)",
                "trainer.resume",
            )
        load_sharded_state(self.actor, sharded)
        state = checkpoint.load_checkpoint(
            path, model=self.actor.inference_model, scheduler=self.actor.scheduler
        )
        self._restore_trainer_state(state)


def is_distributed_run(cfg: Config) -> bool:
    """True for a sharded engine, or when torchrun started more than one process."""
    return cfg.actor.engine != "single" or int(os.environ.get("WORLD_SIZE", "1")) > 1


def run_distributed(cfg: Config) -> int:
    """``otbrl train`` under torchrun: build, fit, tear the process group down; exit status."""
    if cfg.actor.engine == "single":
        raise ConfigError(
            f"'actor.engine' is 'single' but torchrun started {os.environ.get('WORLD_SIZE')} "
            "processes; use actor.engine=fsdp or actor.engine=tp",
            "actor.engine",
        )
    from otbrl.engine.dist import teardown_distributed

    try:
        DistributedTrainer(cfg).fit()
    finally:
        teardown_distributed()
    return 0
