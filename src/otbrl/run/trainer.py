"""The RL loop for 1..N processes. One step, as ``train_step`` states it::

    sample   = source.next(step)      # this rank's share of the step's prompts, n responses
                                      # each, scored: sampled now, in dynamic-sampling rounds
                                      # or ahead by a producer (otbrl.run.sources)
    batch   += each engine's statistics the spec needs, in one forward each
               (policy: old_log_probs, entropy [, sum_pi_squared]; reference: ref_log_probs;
                teacher: teacher_log_probs; critic: values)
    weights  = rollout correction (token_tis / seq_mis) of the rollout engine's log-probs
    rewards  = token_level_scores [− β·KL] [+ c·(log π_teacher − log π)]
    advantages, returns = estimator(batch)
    critic.update(value loss); policy.update(policy loss); source.sync_weights(policy)
    metrics  = step_metrics(batch), averaged over ranks; validate; checkpoint

Orchestration only: every equation lives in ``ops`` / ``algos``, every decision in the
``RunSpec`` (``otbrl.run.spec``; the trainer reads no raw config), the parts are built by
``otbrl.run.build``, persistence is ``otbrl.store`` and the metrics log ``otbrl.report``.

Under ``torchrun`` every rank runs this same loop, with its own share of the prompts: all
``rollout.n`` responses of a prompt are generated and trained on the rank that owns it, so
group-relative estimators (GRPO, RLOO, OTB) compute exactly the one-process advantages
locally. Only rank 0 prints and writes the run directory; checkpoints are collective and resume
on any engine and world size.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
from torch import Tensor

from otbrl.algos.advantages import compute_advantage
from otbrl.algos.metrics import step_metrics
from otbrl.algos.reductions import masked_mean
from otbrl.algos.rollout_correction import correct_for_rollout, rollout_is_weights
from otbrl.algos.token_rewards import token_level_rewards
from otbrl.config import Config
from otbrl.engine.memory import peak_memory_gb, reset_peak_memory, state_memory
from otbrl.engine.state import EngineState
from otbrl.engine.trainable import UpdateStats, check_skipped
from otbrl.engine.world import collective_guard, start_world, teardown_distributed
from otbrl.report.metrics_log import MetricsLogger
from otbrl.report.plots import plot_run
from otbrl.run.announce import interrupted_line, say, startup_lines
from otbrl.run.build import build_run, model_path
from otbrl.run.claim import claim_run_dir
from otbrl.run.plan import Plan, plan_run
from otbrl.run.seeds import seed_everything
from otbrl.store import checkpoint
from otbrl.store.rundir import RunDir

# the timing key of each engine's statistics forward
TIMING = {"policy": "old_stats", "reference": "ref", "teacher": "teacher", "critic": "values"}


@contextlib.contextmanager
def _timed(timing: dict, name: str):
    start = time.perf_counter()
    yield
    timing[f"timing/{name}"] = time.perf_counter() - start


class Trainer:
    """Builds the run from a ``Config`` (and the ``Plan`` that validated it) and runs ``fit()``.

    Every process of a ``torchrun`` job constructs one; on one process no process group is
    created. ``plan`` defaults to ``plan_run(cfg)`` and ``run_dir`` to
    ``claim_run_dir(cfg)`` (the CLI passes the ones it made); the run directory's lock is held
    until ``fit()`` returns.
    """

    def __init__(self, cfg: Config, plan: Plan | None = None, run_dir: RunDir | None = None):
        plan = plan or plan_run(cfg)
        self.run = run_dir if run_dir is not None else claim_run_dir(cfg)
        try:
            self._build(plan)
        except BaseException:
            self.run.release()
            raise

    def _build(self, plan: Plan) -> None:
        self.plan, self.spec = plan, plan.spec
        self.settings = settings = plan.spec.trainer  # the loop's own: trainer.*
        # Before the process group exists: every rank takes the warm-start cache's lock, the
        # first builds it and the others wait there, not in a collective that would time out.
        path = model_path(self.spec.model)
        self.world = start_world(self.spec.dims, timeout_s=settings.dist_timeout_s)
        seed_everything(self.spec.seed)
        self.output_dir = Path(settings.output_dir)
        self.ckpt_root = self.output_dir / "checkpoints"
        self.parts = parts = build_run(plan, self.world, path)
        self.tokenizer, self.eos_ids, self.source = parts.tokenizer, parts.eos_ids, parts.source
        self.engines, self.frozen = parts.engines, parts.frozen
        self.policy_loss, self.critic_loss = parts.policy_loss, parts.critic_loss
        self.step = 0
        self._memory_logged = False  # memory/params_gb and optimizer_gb: with the first step
        self.initial_val: dict[str, float] = {}  # val/* at step 0 (not resumed)
        self.last_val: dict[str, float] = {}
        self.initial_val_accuracy: float | None = None
        self.last_val_accuracy: float | None = None
        # wall time of the steps so far: earlier (resumed) segments + this fit() call's
        self._earlier_wall_seconds = 0.0
        self._fit_start = time.perf_counter()

    @property
    def policy(self):
        return self.engines["policy"]

    # -- one step ---------------------------------------------------------------------------------
    def statistics(self, batch: dict[str, Tensor], timing: dict, *, policy: bool = True) -> None:
        """Each engine's share of the plan's needs, from one forward of the sampled batch
        (``policy=False``: but the policy's, which its update's forwards hand out)."""
        engines = {**self.engines, **self.frozen}
        for name, key in TIMING.items():
            outputs = self.spec.outputs(name)
            if outputs and (policy or name != "policy"):
                with _timed(timing, key):
                    stats = engines[name].compute(batch, outputs)
                batch.update(self.spec.batch_stats(name, stats))

    def rollout_correction(self, batch: dict[str, Tensor]) -> dict[str, float]:
        """The rollout engine's log-probs against the trainer's, and (with
        ``algorithm.rollout_correction`` or ``algorithm.off_policy``) the importance weights
        that correct for it; ``seq_mis`` drops the sequences outside its band from
        ``response_mask`` (``otbrl.algos.rollout_correction.correct_for_rollout``)."""
        weights, batch["response_mask"], metrics = correct_for_rollout(
            batch["old_log_probs"],
            batch["rollout_log_probs"],
            batch["response_mask"],
            mode=self.spec.correction,
            cap=self.spec.correction_cap,
        )
        if weights is not None:
            batch["rollout_is_weights"] = weights
        return metrics

    def advantage(self, batch: dict[str, Tensor]) -> dict[str, float]:
        """Token rewards (minus the in-reward KL when on, plus the distillation signal when a
        teacher is set: ``token_level_rewards``), then the registry's estimator."""
        spec = self.spec
        batch["token_level_rewards"], metrics = token_level_rewards(
            batch,
            kl_coef=spec.kl_in_reward_coef,
            distill_coef=spec.distill_coef,
            task_reward=spec.distill_task_reward,
        )
        batch["advantages"], batch["returns"] = compute_advantage(
            spec.estimator, **batch, index=batch["uid"], **spec.estimator_options
        )
        metrics["train/advantage_mean"] = float(
            masked_mean(batch["advantages"], batch["response_mask"])
        )
        return metrics

    def update_stats(self, batch: dict[str, Tensor]) -> UpdateStats | None:
        """How the policy's update hands out the batch's statistics (``spec.stats_in_update``),
        or None: they come from a separate pass first. Under ``groups`` the policy's
        micro-batches hold whole groups and each micro-batch's advantages are computed from its
        own forward, before its backward; a step whose groups do not fit the micro-batches
        takes the pass (``policy/one_forward`` is 0). The batch gets every key the update fills
        (zeros until then), so the whole batch holds them afterwards."""
        mode = self.spec.stats_in_update
        if mode is None:
            return None
        bins = None
        if mode == "groups":
            bins = self.policy.group_micro_batches(batch, batch["uid"])
            if bins is None:
                return None
        mask = batch["response_mask"]
        filled = list(self.spec.batch_stats("policy", dict.fromkeys(self.spec.outputs("policy"))))
        if self.spec.correction != "none":
            filled.append("rollout_is_weights")
        if mode == "groups":
            filled += ["token_level_rewards", "advantages", "returns"]
        for key in filled:
            batch[key] = torch.zeros_like(mask, dtype=torch.float32)

        def fill(rows: Tensor, outputs: dict[str, Tensor]) -> dict[str, Tensor]:
            part = {key: value[rows] for key, value in batch.items()}
            part.update(self.spec.batch_stats("policy", outputs))
            if self.spec.correction != "none":
                part["rollout_is_weights"] = rollout_is_weights(
                    part["old_log_probs"],
                    part["rollout_log_probs"],
                    part["response_mask"],
                    mode=self.spec.correction,
                    cap=self.spec.correction_cap,
                )[0]
            if mode == "groups":
                self.advantage(part)
            for key in filled:
                batch[key][rows] = part[key]
            return {key: part[key] for key in {*self.policy_loss.batch_keys, *filled}}

        return UpdateStats(self.spec.outputs("policy"), fill, bins)

    def train_step(self) -> dict[str, float]:
        """One full RL step on every rank; returns its metrics (reduced over ranks)."""
        with collective_guard(f"training step {self.step}"):
            timing: dict[str, float] = {}
            reset_peak_memory(self.world.device)
            start = time.perf_counter()
            sample = self.source.next(self.step)  # its scores may still be on their way
            batch = sample.batch
            in_update = self.update_stats(batch)  # None: the policy's own statistics pass
            self.statistics(batch, timing, policy=in_update is None)
            sample = sample.resolve()  # token_level_scores; timing/rollout, timing/reward
            metrics = dict(sample.metrics)
            metrics["policy/one_forward"] = float(in_update is not None)
            if in_update is None:
                metrics.update(self.rollout_correction(batch))
            if in_update is None or self.spec.stats_in_update == "rows":
                with _timed(timing, "adv"):
                    metrics.update(self.advantage(batch))
            with _timed(timing, "update"):
                if self.critic_loss is not None:
                    metrics.update(self.engines["critic"].update(batch, self.critic_loss))
                metrics.update(self.policy.update(batch, self.policy_loss, in_update))
                self.source.sync_weights(self.policy.model)
            if in_update is not None:  # the whole batch's metrics, from what the update filled
                metrics.update(self.rollout_correction(batch))
                if self.spec.stats_in_update == "groups":  # the same values, group by group
                    with _timed(timing, "adv"):
                        metrics.update(self.advantage(batch))
            metrics.update(
                step_metrics(
                    batch,
                    grad_norm=metrics["policy/grad_norm"],
                    response_space=self.spec.response_space,
                )
            )
            timing["timing/step"] = time.perf_counter() - start
            metrics["throughput/tokens_per_s"] = (
                float(batch["attention_mask"].sum()) / timing["timing/step"]
            )
            metrics.update(timing)
            metrics["memory/peak_gb"] = peak_memory_gb(self.world.device)
            if not self._memory_logged:  # the optimizer state exists after the first update
                # every model this process holds (policy, reference, teacher, critic), its shards
                metrics.update(state_memory([*self.engines.values(), *self.frozen.values()]))
                self._memory_logged = True
            return self.world.mean_metrics(metrics)

    def validate(self, with_tools: bool = True, logger=None) -> dict[str, float]:
        """``val/*`` on the validation rows (greedy unless ``trainer.val_greedy=false``), sampled
        as training samples (``otbrl.run.evaluate.Validator``; ``with_tools=False``: the same
        policy answering alone). With a ``logger`` the first ``trainer.log_generations``
        samples go to its generations log."""
        generations = self.settings.log_generations if logger is not None else 0
        result = self.parts.validator(self.step, with_tools=with_tools, generations=generations)
        if logger is not None and result.generations:
            logger.log_generations(self.step, result.generations)
        return result.metrics

    # -- checkpoints ------------------------------------------------------------------------------
    def _resume(self) -> None:
        """From the checkpoint ``claim_run_dir`` chose and verified before any model loaded
        (rank 0 decides; the other ranks get its choice); then the rollout gets the policy's
        weights where it may hold others (a resumed policy, servers the user started)."""
        path = self.run.resume_from if self.world.is_main else None
        path = self.world.broadcast_object(None if path is None else str(path))
        if path is not None:
            engines = {name: EngineState(e) for name, e in self.engines.items()}
            state = checkpoint.load_checkpoint(Path(path), engines=engines, verify=False)
            self.step = int(state["step"])
            self.source.load_state_dict(state["dataset"])
            checkpoint.restore_rng_state(state["rng"])
            self.initial_val_accuracy = state.get("initial_val_accuracy")
            self.last_val_accuracy = state.get("last_val_accuracy")
            self._earlier_wall_seconds = float(state.get("wall_seconds", 0.0))
        if path is not None or self.spec.sync_at_start:
            self.source.sync_weights(self.policy.model)

    def _save(self) -> None:
        state = {
            "step": self.step,
            "dataset": self.source.state_dict(),
            "rng": checkpoint.capture_rng_state(),
            "initial_val_accuracy": self.initial_val_accuracy,
            "last_val_accuracy": self.last_val_accuracy,
            "wall_seconds": self._wall_seconds(),
        }
        checkpoint.save_checkpoint(
            self.ckpt_root,
            self.step,
            engines={name: EngineState(e) for name, e in self.engines.items()},
            tokenizer=self.tokenizer,
            trainer_state=state,
            config=dict(self.spec.record),
            keep_last=self.settings.keep_last_checkpoints or None,
        )

    def _wall_seconds(self) -> float:
        """Wall time of the run so far, summed over resumed segments (time a killed segment
        spent after its last checkpoint is not counted: those steps were redone)."""
        return self._earlier_wall_seconds + time.perf_counter() - self._fit_start

    # -- the loop ---------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train ``trainer.total_steps`` steps (resuming if asked); returns the summary dict.

        Collective: tears the process group down at the end of a multi-process run.
        """
        try:
            return self._fit()
        except KeyboardInterrupt as err:
            if self.world.is_main:
                say(interrupted_line(self.ckpt_root, self.output_dir, self.step))
                err.otbrl_reported = True  # the CLI adds no second line
            raise
        finally:
            self.parts.close()  # before the process group goes: a vLLM engine holds groups
            if self.world.mesh is not None:  # only the group this run created
                teardown_distributed()
            self.run.release()

    def _fit(self) -> dict:
        settings = self.settings
        self._fit_start = time.perf_counter()
        self._resume()
        logger = self._open_logger()
        log = logger.log if logger is not None else (lambda step, metrics: None)
        validating = settings.val_every > 0 and bool(self.plan.val_rows)
        summary: dict = {}
        try:
            if validating and self.step == 0:
                self.initial_val = self.last_val = self.validate(logger=logger)
                self.initial_val_accuracy = self.last_val_accuracy = self.last_val["val/accuracy"]
                log(0, dict(self.last_val))
            while self.step < settings.total_steps:
                self.step += 1
                metrics = self.train_step()
                elapsed = time.perf_counter() - self._fit_start
                # every rank stops at the same step: rank clocks differ, the vote does not
                out_of_time = self.world.sum([0 < settings.max_wall_seconds <= elapsed])[0] > 0
                last = self.step == settings.total_steps or out_of_time
                if validating and (self.step % settings.val_every == 0 or last):
                    start = time.perf_counter()
                    self.last_val = self.validate(logger=logger)
                    self.last_val_accuracy = self.last_val["val/accuracy"]
                    metrics.update(self.last_val)
                    metrics["timing/val"] = time.perf_counter() - start
                log(self.step, metrics)
                check_skipped(self.engines, settings.max_skipped_steps, self.step)
                if settings.save_every > 0 and (self.step % settings.save_every == 0 or last):
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
                "adv_estimator": self.spec.estimator,
            }
            if validating and self.plan.tools:
                final.update(self._tool_summary())
            if logger is not None:
                summary = logger.summary(final)
        finally:
            if logger is not None:
                logger.close()
        if self.world.is_main:
            plot_run(self.output_dir)
        return summary

    def _open_logger(self) -> MetricsLogger | None:
        """Rank 0: the start-up lines, then the run's metrics log (None on the other ranks)."""
        if not self.world.is_main:
            return None
        where = {"ckpt_root": self.ckpt_root, "output_dir": self.output_dir, "step": self.step}
        notes, engines = self.plan.notes, self.engines.values()
        for line in startup_lines(self.settings, notes=notes, engines=engines, **where):
            say(line)
        settings = self.settings
        return MetricsLogger(
            self.output_dir,
            backends=settings.logger,
            total_steps=settings.total_steps,
            config=dict(self.spec.record),
            initial_step=self.step,
        )

    def _tool_summary(self) -> dict:
        """The tool-call rates at the start and end, and the final policy's accuracy with the
        tools taken away (what the tools are worth to it)."""
        return {
            "initial_val_tool_call_rate": self.initial_val.get("val/tool_call_rate"),
            "final_val_tool_call_rate": self.last_val.get("val/tool_call_rate"),
            "final_val_accuracy_without_tools": self.validate(with_tools=False)["val/accuracy"],
        }
