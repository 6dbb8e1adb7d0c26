"""The RL loop for 1..N processes, orchestration only: every equation lives in ``ops``/``algos``.

One step: this rank's prompts → rollout → reward → old statistics (policy: log-probs and
exactly the stats the estimator and the enabled metrics need, in one forward; reference:
``ref_log_probs``; critic: ``values``) → advantages via the registry → critic and policy
updates with the losses built from the config → rollout weights synced → metrics (reduced over
ranks) → validation → checkpoint.

Under ``torchrun`` every rank runs this same loop. The ``World`` deals each data-parallel rank
a contiguous share of the step's prompts; all ``rollout.n`` responses of a prompt are
generated and trained on the rank that owns it, so group-relative estimators (GRPO, RLOO,
OTB) compute exactly the one-process advantages locally. Only rank 0 prints and writes the run
directory; checkpoints are collective and resume on any engine and world size.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
from torch import Tensor

from otbrl.algos import losses
from otbrl.algos._common import masked_mean
from otbrl.algos.advantages import compute_advantage
from otbrl.algos.metrics import explained_variance, otb_metrics
from otbrl.algos.rollout_correction import rollout_is_weights, rollout_mismatch_metrics
from otbrl.config import Config, to_dict
from otbrl.data import PromptDataset, encode_prompts
from otbrl.engine.engine import Engine, NumericsError
from otbrl.engine.world import collective_guard, start_world, teardown_distributed
from otbrl.models import eos_token_ids, load_model_and_tokenizer, load_value_model
from otbrl.rewards import score_responses
from otbrl.rewards.placement import place_scores
from otbrl.rollout import (
    SamplingParams,
    completions_to_batch,
    decode_responses,
    decode_transcripts,
    tool_metrics,
    transcript_rows,
    unpad_prompts,
)
from otbrl.run import checkpoint
from otbrl.run.build import (
    POLICY_STATS,
    Plan,
    critic_loss,
    estimator_options,
    model_path,
    policy_loss,
    seed_everything,
    step_seed,
    validate_config,
)
from otbrl.run.evaluate import evaluate
from otbrl.run.outputs import MetricsLogger
from otbrl.run.plotting import plot_run
from otbrl.run.rollout_setup import build_agent, build_rollout
from otbrl.run.rundir import RunDir, claim_run_dir
from otbrl.tools import tools_for_row


@contextlib.contextmanager
def _timed(timing: dict, name: str):
    start = time.perf_counter()
    yield
    timing[f"timing/{name}"] = time.perf_counter() - start


class Trainer:
    """Builds the run from a ``Config`` (and the ``Plan`` that validated it) and runs ``fit()``.

    Every process of a ``torchrun`` job constructs one; on one process no process group is
    created. ``plan`` defaults to ``validate_config(cfg)`` and ``run_dir`` to
    ``claim_run_dir(cfg)`` (the CLI passes the ones it made); the run directory's lock is held
    until ``fit()`` returns.
    """

    def __init__(self, cfg: Config, plan: Plan | None = None, run_dir: RunDir | None = None):
        plan = plan or validate_config(cfg)
        self.run = run_dir if run_dir is not None else claim_run_dir(cfg)
        try:
            self._build(cfg, plan)
        except BaseException:
            self.run.release()
            raise

    def _build(self, cfg: Config, plan: Plan) -> None:
        self.cfg = cfg
        self.plan = plan
        a = cfg.actor
        # Before the process group exists: every rank takes the warm-start cache's lock, the
        # first builds it and the others wait there, not in a collective that would time out.
        path = model_path(cfg)
        self.world = world = start_world(
            distributed=plan.distributed,
            sp=a.ulysses_sequence_parallel_size,
            tp=a.tensor_parallel_size,
            timeout_s=cfg.trainer.dist_timeout_s,
        )
        seed_everything(cfg.trainer.seed)
        self.output_dir = Path(cfg.trainer.output_dir)
        self.ckpt_root = self.output_dir / "checkpoints"
        model, self.tokenizer = load_model_and_tokenizer(path, dtype=cfg.model.dtype)
        self.eos_ids = torch.tensor(eos_token_ids(model, self.tokenizer))
        train_rows, self.val_rows = plan.train_rows, plan.val_rows
        self.dataset = PromptDataset(
            train_rows,
            self.tokenizer,
            max_prompt_length=cfg.data.max_prompt_length,
            batch_size=cfg.data.train_batch_size,
            seed=cfg.data.seed,
            tools=plan.tools,
        )
        longest = self.dataset.longest_prompt
        if self.val_rows:
            val = encode_prompts(self.val_rows, self.tokenizer, 10**9, plan.tools)
            longest = max(longest, int(val["attention_mask"].sum(dim=1).max()))
        # before the engine shards the model: an HF rollout on several processes copies it
        self.rollout = build_rollout(
            cfg, model, self.tokenizer, world, path, longest + cfg.rollout.max_new_tokens
        )
        # multi-turn tool use: the agent loop over that engine (None: single-turn rollouts)
        self.agent = build_agent(
            cfg, plan, self.rollout, self.tokenizer, self.eos_ids.tolist(), path
        )
        common = {
            "world": world,
            "parallelism": plan.engine,
            "packed": cfg.model.use_remove_padding,
            "temperature": cfg.rollout.temperature,
            "seed": cfg.trainer.seed,
        }
        sequences = plan.mini_batch_size * cfg.rollout.n
        self.engines: dict[str, Engine] = {
            "policy": Engine(
                model,
                a,
                name="policy",
                fused=a.use_fused_kernels,
                mini_batch_size=sequences,
                **common,
            )
        }
        if plan.use_critic:
            value_model = load_value_model(cfg.critic.model_path or path, dtype=cfg.model.dtype)
            self.engines["critic"] = Engine(
                value_model,
                cfg.critic,
                name="critic",
                value=True,
                mini_batch_size=sequences,
                **common,
            )
        if plan.use_reference:
            ref_model, _ = load_model_and_tokenizer(path, dtype=cfg.model.dtype)
            self.reference = Engine(
                ref_model, None, name="reference", micro_batch_size=a.micro_batch_size, **common
            )
        self.policy_loss = policy_loss(cfg)
        self.critic_loss = critic_loss(cfg) if plan.use_critic else None
        self.step = 0
        self.initial_val_accuracy: float | None = None
        self.last_val_accuracy: float | None = None
        self.last_val_metrics: dict[str, float] = {}  # val/* beyond the accuracy (tool use)
        self.initial_val_metrics: dict[str, float] = {}  # the same at step 0 (not resumed)
        # wall time of the steps so far: earlier (resumed) segments + this fit() call's
        self._earlier_wall_seconds = 0.0
        self._fit_start = time.perf_counter()

    @property
    def policy(self) -> Engine:
        return self.engines["policy"]

    # -- checkpoints -----------------------------------------------------------------------------
    def _resume_path(self) -> Path | None:
        """The checkpoint ``claim_run_dir`` chose and verified before any model loaded (rank 0
        decides; the other ranks get its choice)."""
        path = self.run.resume_from if self.world.is_main else None
        path = self.world.broadcast_object(None if path is None else str(path))
        return None if path is None else Path(path)

    def _resume(self) -> None:
        path = self._resume_path()
        if path is None:
            return
        state = checkpoint.load_checkpoint(path, engines=self.engines, verify=False)
        self._sync_rollout_weights()
        self.step = int(state["step"])
        self.dataset.load_state_dict(state["dataset"])
        checkpoint.restore_rng_state(state["rng"])
        self.initial_val_accuracy = state.get("initial_val_accuracy")
        self.last_val_accuracy = state.get("last_val_accuracy")
        self._earlier_wall_seconds = float(state.get("wall_seconds", 0.0))

    def _save(self) -> None:
        state = {
            "step": self.step,
            "dataset": self.dataset.state_dict(),
            "rng": checkpoint.capture_rng_state(),
            "initial_val_accuracy": self.initial_val_accuracy,
            "last_val_accuracy": self.last_val_accuracy,
            "wall_seconds": self._wall_seconds(),
        }
        checkpoint.save_checkpoint(
            self.ckpt_root,
            self.step,
            engines=self.engines,
            tokenizer=self.tokenizer,
            trainer_state=state,
            config=to_dict(self.cfg),
            keep_last=self.cfg.trainer.keep_last_checkpoints or None,
        )

    def _wall_seconds(self) -> float:
        """Wall time of the run so far, summed over resumed segments (time a killed segment
        spent after its last checkpoint is not counted: those steps were redone)."""
        return self._earlier_wall_seconds + time.perf_counter() - self._fit_start

    def _sync_rollout_weights(self) -> None:
        """Stream the trained weights into the rollout engine (collective on several
        processes; nothing to do when it samples with the training model itself)."""
        self.rollout.wake_up()
        self.rollout.sync_weights(self.policy.full_tensors())

    # -- one step ---------------------------------------------------------------------------------
    def generate(self) -> tuple[dict[str, Tensor], list[dict]]:
        """This rank's share of the next prompts, n responses each; (batch, repeated rows)."""
        cfg = self.cfg
        rows = self.world.shard(self.dataset.next_batch())
        enc = encode_prompts(rows, self.tokenizer, cfg.data.max_prompt_length, self.plan.tools)
        params = SamplingParams(
            n=cfg.rollout.n,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            max_tokens=cfg.rollout.max_new_tokens,
            stop_token_ids=tuple(self.eos_ids.tolist()),
            seed=step_seed(cfg.trainer.seed, self.step, self.world.dp_rank),
        )
        prompts = unpad_prompts(enc["input_ids"], enc["attention_mask"])
        if self.agent is None:
            completions = self.rollout.generate(prompts, params)
        else:
            allowed = [tools_for_row(row, self.plan.tools) for row in rows]
            completions = self.agent.generate(prompts, params, allowed=allowed)
        self.rollout.sleep()  # frees the engine's memory for training, where supported
        batch = completions_to_batch(
            enc["input_ids"], enc["attention_mask"], completions, pad_id=self.tokenizer.pad_token_id
        )
        batch["uid"] = batch["uid"] + self.world.dp_rank * len(rows)  # global prompt index
        return batch, [row for row in rows for _ in range(cfg.rollout.n)]

    def reward(self, batch: dict[str, Tensor], rows: list[dict]) -> dict[str, float]:
        """Score decoded responses (a multi-turn one on its final turn, its whole transcript in
        ``extra_info``); the scalar reward sits on the last trained token."""
        mask = batch["response_mask"]
        texts = decode_responses(self.tokenizer, batch["responses"], mask)
        multi_turn = "num_turns" in batch
        if multi_turn:
            attention = batch["attention_mask"][:, batch["prompts"].shape[1] :]
            transcripts = decode_transcripts(self.tokenizer, batch["responses"], attention)
            rows = transcript_rows(rows, transcripts, batch)
        scores, info = score_responses(
            texts,
            rows,
            function=self.plan.reward_fn,
            on_error=self.cfg.reward.on_error,
            timeout_s=self.cfg.reward.timeout_s,
        )
        score = torch.tensor(scores, dtype=torch.float32)
        batch["token_level_scores"] = place_scores(score, mask)
        metrics = {
            "train/reward_mean": float(score.mean()),
            "train/reward_max": float(score.max()),
            "train/response_length_mean": float(mask.sum(dim=1).mean()),
            # truncated = ended at the length cap without a stop token
            "train/response_clip_ratio": float(batch["truncated"].float().mean()),
        }
        metrics.update({k: float(v) for k, v in info.items()})
        if multi_turn:
            metrics.update(tool_metrics(batch))
        return metrics

    def old_stats(self, batch: dict[str, Tensor], timing: dict) -> None:
        """The statistics of the sampling-time models, each from the engine that provides it."""
        with _timed(timing, "old_stats"):
            stats = self.policy.compute(batch, self.plan.policy_outputs)
            batch.update({key: stats[out] for key, out in POLICY_STATS.items() if out in stats})
        if self.plan.use_reference:
            with _timed(timing, "ref"):
                batch["ref_log_probs"] = self.reference.compute(batch, frozenset({"log_probs"}))[
                    "log_probs"
                ]
        if self.plan.use_critic:
            with _timed(timing, "values"):
                batch["values"] = self.engines["critic"].compute(batch, frozenset({"values"}))[
                    "values"
                ]

    def rollout_correction(self, batch: dict[str, Tensor]) -> dict[str, float]:
        """How far the rollout engine's log-probs are from the trainer's, and (when
        ``algorithm.rollout_correction`` is on) the importance weights that correct for it: they
        reach the policy loss and OTB's energy W as ``rollout_is_weights``; ``seq_mis`` drops the
        sequences outside the band from ``response_mask``."""
        cfg = self.cfg.algorithm
        old, rollout, mask = (
            batch["old_log_probs"],
            batch["rollout_log_probs"],
            batch["response_mask"],
        )
        metrics = rollout_mismatch_metrics(old, rollout, mask)
        if cfg.rollout_correction != "none":
            weights, keep, extra = rollout_is_weights(
                old, rollout, mask, mode=cfg.rollout_correction, cap=cfg.rollout_is_cap
            )
            batch["rollout_is_weights"] = weights
            batch["response_mask"] = mask * keep
            metrics.update(extra)
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
        batch["advantages"], batch["returns"] = compute_advantage(
            cfg.adv_estimator, **batch, index=batch["uid"], **estimator_options(self.cfg)
        )
        metrics["train/advantage_mean"] = float(
            masked_mean(batch["advantages"], batch["response_mask"])
        )
        return metrics

    def train_step(self) -> dict[str, float]:
        """One full RL step on every rank; returns its metrics (reduced over ranks)."""
        with collective_guard(f"training step {self.step}"):
            timing: dict[str, float] = {}
            start = time.perf_counter()
            with _timed(timing, "rollout"):
                batch, rows = self.generate()
            with _timed(timing, "reward"):
                metrics = self.reward(batch, rows)
            self.old_stats(batch, timing)
            metrics.update(self.rollout_correction(batch))
            with _timed(timing, "adv"):
                metrics.update(self.advantage(batch))
            with _timed(timing, "update"):
                if self.critic_loss is not None:
                    metrics.update(self.engines["critic"].update(batch, self.critic_loss))
                metrics.update(self.policy.update(batch, self.policy_loss))
                self._sync_rollout_weights()
            metrics.update(self._batch_metrics(batch, metrics))
            timing["timing/step"] = time.perf_counter() - start
            tokens = float(batch["attention_mask"].sum())
            metrics["throughput/tokens_per_s"] = tokens / timing["timing/step"]
            metrics.update(timing)
            return self.world.mean_metrics(metrics)

    def _batch_metrics(self, batch: dict[str, Tensor], metrics: dict) -> dict[str, float]:
        mask = batch["response_mask"]
        out = {"policy/entropy_mean": float(masked_mean(batch["entropy"], mask))}
        if "sum_pi_squared" in batch:
            out["policy/sum_pi_squared_mean"] = float(masked_mean(batch["sum_pi_squared"], mask))
            # the update's mean pre-clip grad norm stands in for the batch-gradient norm
            extra = otb_metrics(
                batch["advantages"],
                mask,
                batch["uid"],
                batch["old_log_probs"],
                batch["sum_pi_squared"],
                grad_norm=metrics["policy/grad_norm"],
            )
            out.update({k: float(v) for k, v in extra.items()})
        if "values" in batch:
            out["critic/values_mean"] = float(masked_mean(batch["values"], mask))
            out["critic/returns_mean"] = float(masked_mean(batch["returns"], mask))
            ev = explained_variance(batch["values"], batch["returns"], mask)
            out["critic/explained_variance"] = float(ev)
        return out

    def validate(self, with_tools: bool = True) -> float:
        """Accuracy on the validation rows (greedy unless ``trainer.val_greedy=false``); each
        rank scores its share with the rollout engine (through the agent loop when tools are
        configured, unless ``with_tools`` is false: the same policy answering alone)."""
        cfg = self.cfg
        rows = self.val_rows[self.world.rank :: self.world.size]
        accuracy = rate = 0.0
        agent = self.agent if with_tools else None
        if rows:
            result = evaluate(
                agent or self.rollout,
                self.tokenizer,
                rows,
                stop_token_ids=self.eos_ids.tolist(),
                max_new_tokens=cfg.rollout.max_new_tokens,
                greedy=cfg.trainer.val_greedy,
                temperature=cfg.trainer.val_temperature,
                batch_size=cfg.trainer.val_batch_size,
                seed=step_seed(cfg.trainer.seed, self.step),
                function=self.plan.reward_fn,
                timeout_s=cfg.reward.timeout_s,
            )
            accuracy, rate = result["accuracy"], result.get("tool_call_rate", 0.0)
        total, called, count = self.world.sum([accuracy * len(rows), rate * len(rows), len(rows)])
        if agent is not None:
            self.last_val_metrics = {"val/tool_call_rate": called / max(count, 1.0)}
        return total / max(count, 1.0)

    def _tool_summary(self) -> dict:
        """The tool-call rates at the start and end, and the final policy's accuracy with the
        tools taken away (what the tools are worth to it)."""
        out = {
            "initial_val_tool_call_rate": self.initial_val_metrics.get("val/tool_call_rate"),
            "final_val_tool_call_rate": self.last_val_metrics.get("val/tool_call_rate"),
        }
        out["final_val_accuracy_without_tools"] = self.validate(with_tools=False)
        return out

    # -- the loop ---------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train ``trainer.total_steps`` steps (resuming if asked); returns the summary dict.

        Collective: tears the process group down at the end of a multi-process run.
        """
        try:
            return self._fit()
        finally:
            close = getattr(self.rollout, "close", None)
            if close is not None:
                close()  # before the process group goes: a vLLM engine holds groups of its own
            if self.world.mesh is not None:  # only the group this run created
                teardown_distributed()
            self.run.release()

    def _check_skipped_steps(self) -> None:
        """A run whose every update is skipped (non-finite gradients) learns nothing: stop."""
        limit = self.cfg.trainer.max_skipped_steps
        for name, engine in self.engines.items():
            if engine.skipped_in_a_row > limit:
                raise NumericsError(
                    f"{name}: the last {engine.skipped_in_a_row} optimizer steps were all "
                    f"skipped (non-finite gradients; see {name}/grad_norm in metrics.jsonl), "
                    f"more than trainer.max_skipped_steps={limit}: stopping at step "
                    f"{self.step} without saving it"
                )

    def _fit(self) -> dict:
        cfg = self.cfg.trainer
        self._fit_start = time.perf_counter()
        self._resume()
        logger = None
        if self.world.is_main:
            logger = MetricsLogger(
                self.output_dir,
                backends=cfg.logger,
                total_steps=cfg.total_steps,
                config=to_dict(self.cfg),
                initial_step=self.step,
            )
        log = logger.log if logger is not None else (lambda step, metrics: None)
        validating = cfg.val_every > 0 and bool(self.val_rows)
        summary: dict = {}
        try:
            if validating and self.step == 0:
                self.initial_val_accuracy = self.last_val_accuracy = self.validate()
                self.initial_val_metrics = dict(self.last_val_metrics)
                log(0, {"val/accuracy": self.initial_val_accuracy, **self.last_val_metrics})
            while self.step < cfg.total_steps:
                self.step += 1
                metrics = self.train_step()
                elapsed = time.perf_counter() - self._fit_start
                # every rank stops at the same step: rank clocks differ, the vote does not
                out_of_time = self.world.sum([0 < cfg.max_wall_seconds <= elapsed])[0] > 0
                last = self.step == cfg.total_steps or out_of_time
                if validating and (self.step % cfg.val_every == 0 or last):
                    start = time.perf_counter()
                    self.last_val_accuracy = self.validate()
                    metrics["val/accuracy"] = self.last_val_accuracy
                    metrics.update(self.last_val_metrics)
                    metrics["timing/val"] = time.perf_counter() - start
                log(self.step, metrics)
                self._check_skipped_steps()
                if cfg.save_every > 0 and (self.step % cfg.save_every == 0 or last):
                    self._save()
                if out_of_time:
                    log(self.step, {"trainer/stopped_at_wall_limit": 1.0})
                    break
            segment = time.perf_counter() - self._fit_start
            final = {
                "initial_val_accuracy": self.initial_val_accuracy,
                "final_val_accuracy": self.last_val_accuracy,
                "steps": self.step,
                "wall_seconds": self._earlier_wall_seconds + segment,
                "segment_wall_seconds": segment,
                "adv_estimator": self.cfg.algorithm.adv_estimator,
            }
            if validating and self.agent is not None:
                final.update(self._tool_summary())
            if logger is not None:
                summary = logger.summary(final)
        finally:
            if logger is not None:
                logger.close()
        if self.world.is_main:
            plot_run(self.output_dir)
        return summary
