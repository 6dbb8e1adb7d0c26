"""The RL loop, orchestration only: every equation lives in ``otbrl.ops`` / ``otbrl.algos``.

One step: rollout → reward → actor forward (old log-probs + exactly the stats the estimator and
the enabled metrics need, in the same forward) → reference log-probs (KL on) → advantage via the
registry → PPO update → metrics → validation → checkpoint.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import random
import time
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from otbrl import checkpoint
from otbrl.algos import losses
from otbrl.algos.advantages import ESTIMATORS, compute_advantage, get_estimator
from otbrl.algos.metrics import otb_metrics
from otbrl.config import Config, ConfigError, to_dict
from otbrl.data import PromptDataset, encode_prompts, get_task, read_parquet_rows
from otbrl.engine.actor import Actor
from otbrl.logging import MetricsLogger, check_backends
from otbrl.models import eos_token_ids, load_model_and_tokenizer
from otbrl.plotting import plot_run
from otbrl.rewards import resolve_reward_function, score_responses
from otbrl.rollout import decode_responses, generate
from otbrl.sft import ensure_warm_start, evaluate_accuracy

# -- configuration checks that need the registries --------------------------------------------
# estimator option -> the config key that sets it
ESTIMATOR_OPTION_KEYS = {
    "gamma": "algorithm.gamma",
    "lam": "algorithm.lam",
    "norm_adv_by_std_in_grpo": "algorithm.norm_adv_by_std_in_grpo",
    "handle_zero_tail": "algorithm.handle_zero_tail",
    "leave_one_out": "algorithm.otb.leave_one_out",
    "energy": "algorithm.otb.energy",
}


def estimator_options(cfg: Config) -> dict:
    """Options that change what the configured estimator computes (and may change its needs)."""
    return {
        option: functools.reduce(getattr, key.split("."), cfg)
        for option, key in ESTIMATOR_OPTION_KEYS.items()
    }


def stat_needs(cfg: Config) -> frozenset[str]:
    """Union of the statistics the estimator (with its options) and the enabled metrics need.

    ``entropy`` feeds ``policy/entropy_mean`` (always on). Σπ² is computed when the estimator
    needs it, or always with ``actor.calculate_sum_pi_squared=true`` (then the variance-proxy
    metrics use it). Raises ``ConfigError`` when ``false`` contradicts the estimator.
    """
    estimator = get_estimator(cfg.algorithm.adv_estimator)
    needs = set(estimator.needs_for(**estimator_options(cfg))) | {"old_log_probs", "entropy"}
    flag = cfg.actor.calculate_sum_pi_squared
    if flag == "false" and "sum_pi_squared" in needs:
        raise ConfigError(
            f"'actor.calculate_sum_pi_squared' is false but 'algorithm.adv_estimator' "
            f"'{cfg.algorithm.adv_estimator}' needs Σπ²; use 'auto' or 'true'",
            "actor.calculate_sum_pi_squared",
        )
    if flag == "true":
        needs.add("sum_pi_squared")
    if cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        needs.add("ref_log_probs")
    return frozenset(needs)


def validate_config(cfg: Config) -> frozenset[str]:
    """Checks needing the registries or the file system; returns the stat needs.

    Runs before any model is loaded; raises ``ConfigError`` naming the key.
    """
    name = cfg.algorithm.adv_estimator
    if name not in ESTIMATORS:
        close = difflib.get_close_matches(name, list(ESTIMATORS), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(
            f"'algorithm.adv_estimator' must be one of {sorted(ESTIMATORS)}, got '{name}'{hint}",
            "algorithm.adv_estimator",
        )
    for key in ("train_files", "val_files"):
        for file in getattr(cfg.data, key):
            if not Path(file).is_file():
                raise ConfigError(f"'data.{key}' file not found: '{file}'", f"data.{key}")
    if cfg.model.path != "builtin" and not (Path(cfg.model.path) / "config.json").is_file():
        raise ConfigError(
            f"'model.path' must be 'builtin' or a local HF model directory with config.json, "
            f"got '{cfg.model.path}'",
            "model.path",
        )
    try:  # an optional logger package missing is reported now, not after the model loads
        check_backends(cfg.trainer.logger)
    except (ImportError, ValueError) as err:
        raise ConfigError(f"'trainer.logger': {err}", "trainer.logger") from None
    if not cfg.data.train_files:
        try:
            task = get_task(cfg.data.task)
        except ValueError as err:
            raise ConfigError(f"'data.task': {err}", "data.task") from None
        longest = task.max_response_chars + 1  # + EOS: a shorter cap truncates right answers
        if cfg.data.max_response_length < longest:
            raise ConfigError(
                f"'data.max_response_length' ({cfg.data.max_response_length}) is shorter than "
                f"the {task.name} task's longest answer ({task.max_response_chars} characters "
                f"+ EOS): set data.max_response_length={longest}",
                "data.max_response_length",
            )
    if cfg.reward.function is not None:
        try:
            resolve_reward_function(cfg.reward.function)
        except (ValueError, TypeError, ImportError, AttributeError) as err:
            raise ConfigError(f"'reward.function': {err}", "reward.function") from None
    return stat_needs(cfg)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextlib.contextmanager
def _timed(timing: dict, name: str):
    start = time.perf_counter()
    yield
    timing[f"timing/{name}"] = time.perf_counter() - start


def _masked_mean(values: Tensor, mask: Tensor) -> float:
    return float((values * mask).sum() / mask.sum().clamp(min=1.0))


def warm_start(cfg: Config) -> Path:
    """The built-in model after its cached supervised warm start (``otbrl sft``)."""
    return ensure_warm_start(
        cfg.sft.cache_dir,
        task=cfg.data.task,
        seed=cfg.trainer.seed,
        lr=cfg.sft.lr,
        batch_size=cfg.sft.batch_size,
        max_steps=cfg.sft.max_steps,
        target_accuracy=cfg.sft.target_accuracy,
        eval_every=cfg.sft.eval_every,
    )


def model_path(cfg: Config) -> Path:
    """``model.path``, or the warm-started built-in model when it is ``builtin``."""
    return warm_start(cfg) if cfg.model.path == "builtin" else Path(cfg.model.path)


def load_rows(cfg: Config) -> tuple[list[dict], list[dict]]:
    """(train rows, validation rows): from parquet files, else from the built-in task."""
    data = cfg.data
    if data.train_files:
        val = read_parquet_rows(data.val_files) if data.val_files else []
        return read_parquet_rows(data.train_files), val
    task = get_task(data.task)
    return task.rows("train", seed=data.seed), task.rows("val", data.val_size, seed=data.seed)


def evaluate_config(cfg: Config) -> tuple[float, int]:
    """(accuracy, number of prompts) of ``model.path`` on the validation rows."""
    model, tokenizer = load_model_and_tokenizer(model_path(cfg), dtype=cfg.model.dtype)
    _, val_rows = load_rows(cfg)
    if not val_rows:
        raise ConfigError("'data.val_files' is empty: nothing to evaluate", "data.val_files")
    accuracy = evaluate_accuracy(
        model,
        tokenizer,
        val_rows,
        max_new_tokens=cfg.rollout.max_new_tokens,
        greedy=cfg.trainer.val_greedy,
        temperature=cfg.trainer.val_temperature,
        batch_size=cfg.trainer.val_batch_size,
        function=resolve_reward_function(cfg.reward.function),
    )
    return accuracy, len(val_rows)


class Trainer:
    """Builds the run from a validated ``Config`` and runs ``fit()``.

    ``cfg`` must have passed ``validate_config`` (the CLI does it before calling this).
    """

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.needs = validate_config(cfg)
        seed_everything(cfg.trainer.seed)
        self.output_dir = Path(cfg.trainer.output_dir)
        self.ckpt_root = self.output_dir / "checkpoints"
        path = model_path(cfg)
        self.model, self.tokenizer = load_model_and_tokenizer(path, dtype=cfg.model.dtype)
        ref_model = None
        if "ref_log_probs" in self.needs:
            ref_model, _ = load_model_and_tokenizer(path, dtype=cfg.model.dtype)
            ref_model.requires_grad_(False)
        self.actor = self.build_actor(ref_model)
        self.reward_fn = resolve_reward_function(cfg.reward.function)
        self.eos_ids = torch.tensor(eos_token_ids(self.model, self.tokenizer))
        train_rows, self.val_rows = load_rows(cfg)
        self.dataset = PromptDataset(
            train_rows,
            self.tokenizer,
            max_prompt_length=cfg.data.max_prompt_length,
            batch_size=cfg.data.train_batch_size,
            seed=cfg.data.seed,
        )
        self.step = 0
        self.initial_val_accuracy: float | None = None
        self.last_val_accuracy: float | None = None
        # wall time of the steps so far: earlier (resumed) segments + this fit() call's
        self._earlier_wall_seconds = 0.0
        self._fit_start = time.perf_counter()

    def build_actor(self, ref_model) -> Actor:
        """The policy engine for ``self.model`` (the distributed trainer returns a sharded one)."""
        cfg = self.cfg
        return Actor(
            self.model,
            cfg.actor,
            ppo_mini_batch_size=cfg.actor.ppo_mini_batch_size * cfg.rollout.n,
            temperature=cfg.rollout.temperature,
            use_remove_padding=cfg.model.use_remove_padding,
            ref_model=ref_model,
            seed=cfg.trainer.seed,
        )

    # -- checkpoints -----------------------------------------------------------------------------
    def _resume_path(self) -> Path | None:
        """The checkpoint ``trainer.resume`` names: none, the latest under the run, or a path."""
        cfg = self.cfg.trainer
        if cfg.resume == "never":
            return None
        path = checkpoint.latest_checkpoint(self.ckpt_root) if cfg.resume == "auto" else cfg.resume
        return None if path is None else Path(path)

    def _resume(self) -> None:
        path = self._resume_path()
        if path is None:
            return
        state = checkpoint.load_checkpoint(
            path,
            model=self.model,
            optimizer=self.actor.optimizer,
            scheduler=self.actor.scheduler,
        )
        self._restore_trainer_state(state)

    def _restore_trainer_state(self, state: dict) -> None:
        """Inverse of ``_trainer_state``."""
        self.step = int(state["step"])
        self.dataset.load_state_dict(state["dataset"])
        self.actor.generator.set_state(state["actor_generator"])
        checkpoint.restore_rng_state(state["rng"])
        self.initial_val_accuracy = state.get("initial_val_accuracy")
        self.last_val_accuracy = state.get("last_val_accuracy")
        self._earlier_wall_seconds = float(state.get("wall_seconds", 0.0))

    def _trainer_state(self) -> dict:
        """What a checkpoint keeps besides weights and optimizer: enough to resume exactly."""
        return {
            "step": self.step,
            "dataset": self.dataset.state_dict(),
            "actor_generator": self.actor.generator.get_state(),
            "rng": checkpoint.capture_rng_state(),
            "initial_val_accuracy": self.initial_val_accuracy,
            "last_val_accuracy": self.last_val_accuracy,
            "wall_seconds": self._wall_seconds(),
        }

    def _wall_seconds(self) -> float:
        """Wall time of the run so far, summed over resumed segments (time a killed segment
        spent after its last checkpoint is not counted: those steps were redone)."""
        return self._earlier_wall_seconds + time.perf_counter() - self._fit_start

    def _save(self) -> None:
        state = self._trainer_state()
        checkpoint.save_checkpoint(
            self.ckpt_root,
            self.step,
            model=self.model,
            tokenizer=self.tokenizer,
            optimizer=self.actor.optimizer,
            scheduler=self.actor.scheduler,
            trainer_state=state,
            config=to_dict(self.cfg),
        )

    # -- one step ---------------------------------------------------------------------------------
    def rollout(self) -> tuple[dict[str, Tensor], list[dict]]:
        """Sample n responses for the next prompts; returns the batch dict and the repeated rows."""
        cfg = self.cfg
        rows = self.dataset.next_batch()
        enc = encode_prompts(rows, self.tokenizer, cfg.data.max_prompt_length)
        n = cfg.rollout.n
        out = generate(
            self.model,
            self.tokenizer,
            enc["input_ids"],
            enc["attention_mask"],
            n=n,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            do_sample=True,
            # a per-step seed makes the samples a function of (seed, step): resume-exact
            seed=cfg.trainer.seed * 1_000_003 + self.step,
        )
        return dict(out), [row for row in rows for _ in range(n)]

    def reward(self, batch: dict[str, Tensor], rows: list[dict]) -> dict[str, float]:
        """Score decoded responses; the scalar reward sits on the last response token."""
        mask = batch["response_mask"]
        lengths = mask.sum(dim=1).long()
        texts = decode_responses(self.tokenizer, batch["responses"], mask)
        scores, info = score_responses(
            texts, rows, function=self.reward_fn, on_error=self.cfg.reward.on_error
        )
        score = torch.tensor(scores, dtype=torch.float32)
        last = batch["responses"].gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
        ended_with_eos = torch.isin(last, self.eos_ids) & (lengths > 0)
        token_scores = torch.zeros_like(mask)
        has_tokens = lengths > 0
        rows_idx = torch.nonzero(has_tokens).squeeze(1)
        token_scores[rows_idx, lengths[has_tokens] - 1] = score[has_tokens]
        batch["token_level_scores"] = token_scores
        metrics = {
            "train/reward_mean": float(score.mean()),
            "train/reward_max": float(score.max()),
            "train/response_length_mean": float(lengths.float().mean()),
            # truncated = ended at the length cap without an EOS
            "train/response_clip_ratio": float((~ended_with_eos).float().mean()),
        }
        metrics.update({k: float(v) for k, v in info.items()})
        return metrics

    def advantage(self, batch: dict[str, Tensor]) -> dict[str, float]:
        """Token rewards (minus the in-reward KL when on), then the registry's estimator."""
        cfg = self.cfg.algorithm
        metrics = {}
        rewards = batch["token_level_scores"]
        if cfg.use_kl_in_reward:
            rewards, kl = losses.kl_in_reward(
                rewards,
                batch["old_log_probs"],
                batch["ref_log_probs"],
                batch["response_mask"],
                coef=cfg.kl_coef,
            )
            metrics["train/kl_in_reward"] = float(kl)
        batch["token_level_rewards"] = rewards
        common = {
            "token_level_rewards": rewards,
            "response_mask": batch["response_mask"],
            "index": batch["uid"],
            "old_log_probs": batch["old_log_probs"],
            "sum_pi_squared": batch.get("sum_pi_squared"),
            **estimator_options(self.cfg),
        }
        batch["advantages"], batch["returns"] = compute_advantage(cfg.adv_estimator, **common)
        metrics["train/advantage_mean"] = _masked_mean(batch["advantages"], batch["response_mask"])
        return metrics

    def train_step(self) -> dict[str, float]:
        """One full RL step; returns its metrics."""
        timing: dict[str, float] = {}
        start = time.perf_counter()
        with _timed(timing, "rollout"):
            batch, rows = self.rollout()
        with _timed(timing, "reward"):
            metrics = self.reward(batch, rows)
        with _timed(timing, "old_stats"):
            stats = self.actor.compute_stats(batch, self.needs, self.cfg.rollout.temperature)
            batch.update(stats)
        if "ref_log_probs" in self.needs:
            with _timed(timing, "ref"):
                batch["ref_log_probs"] = self.actor.compute_ref_log_probs(batch)
        with _timed(timing, "adv"):
            metrics.update(self.advantage(batch))
        with _timed(timing, "update"):
            metrics.update(self.actor.update(batch))
        mask = batch["response_mask"]
        metrics["policy/entropy_mean"] = _masked_mean(batch["entropy"], mask)
        if "sum_pi_squared" in batch:
            metrics["policy/sum_pi_squared_mean"] = _masked_mean(batch["sum_pi_squared"], mask)
            # the update's mean pre-clip grad norm stands in for the batch-gradient norm
            extra = otb_metrics(
                batch["advantages"],
                mask,
                batch["uid"],
                batch["old_log_probs"],
                batch["sum_pi_squared"],
                grad_norm=metrics["policy/grad_norm"],
            )
            metrics.update({k: float(v) for k, v in extra.items()})
        timing["timing/step"] = time.perf_counter() - start
        tokens = float(batch["attention_mask"].sum())
        metrics["throughput/tokens_per_s"] = tokens / timing["timing/step"]
        metrics.update(timing)
        return metrics

    def validate(self) -> float:
        """Accuracy on the validation rows (greedy unless ``trainer.val_greedy=false``)."""
        cfg = self.cfg
        return evaluate_accuracy(
            self.model,
            self.tokenizer,
            self.val_rows,
            max_new_tokens=cfg.rollout.max_new_tokens,
            greedy=cfg.trainer.val_greedy,
            temperature=cfg.trainer.val_temperature,
            batch_size=cfg.trainer.val_batch_size,
            seed=cfg.trainer.seed + self.step,
            function=self.reward_fn,
        )

    # -- the loop ---------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train ``trainer.total_steps`` steps (resuming if asked); returns the summary dict."""
        cfg = self.cfg.trainer
        self._fit_start = time.perf_counter()
        self._resume()
        logger = MetricsLogger(
            self.output_dir,
            backends=cfg.logger,
            total_steps=cfg.total_steps,
            config=to_dict(self.cfg),
            initial_step=self.step,
        )
        validating = cfg.val_every > 0 and bool(self.val_rows)
        try:
            if validating and self.step == 0:
                self.initial_val_accuracy = self.last_val_accuracy = self.validate()
                logger.log(0, {"val/accuracy": self.initial_val_accuracy})
            while self.step < cfg.total_steps:
                self.step += 1
                metrics = self.train_step()
                elapsed = time.perf_counter() - self._fit_start
                out_of_time = 0 < cfg.max_wall_seconds <= elapsed
                last = self.step == cfg.total_steps or out_of_time
                if validating and (self.step % cfg.val_every == 0 or last):
                    start = time.perf_counter()
                    self.last_val_accuracy = self.validate()
                    metrics["val/accuracy"] = self.last_val_accuracy
                    metrics["timing/val"] = time.perf_counter() - start
                logger.log(self.step, metrics)
                if cfg.save_every > 0 and (self.step % cfg.save_every == 0 or last):
                    self._save()
                if out_of_time:
                    logger.log(self.step, {"trainer/stopped_at_wall_limit": 1.0})
                    break
            segment = time.perf_counter() - self._fit_start
            summary = logger.summary(
                {
                    "initial_val_accuracy": self.initial_val_accuracy,
                    "final_val_accuracy": self.last_val_accuracy,
                    "steps": self.step,
                    "wall_seconds": self._earlier_wall_seconds + segment,
                    "segment_wall_seconds": segment,
                    "adv_estimator": self.cfg.algorithm.adv_estimator,
                }
            )
        finally:
            logger.close()
        plot_run(self.output_dir)
        return summary
