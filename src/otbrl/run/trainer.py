"""The RL loop for 1..N processes. One step, as ``train_step`` states it::

    rows     = this rank's share of the next prompts
    sample   = sample_batch(sampler, rows)          # n responses each, scored, reward placed
    batch   += each engine's statistics the plan needs, in one forward each
               (policy: old_log_probs, entropy [, sum_pi_squared]; reference: ref_log_probs;
                teacher: teacher_log_probs; critic: values)
    weights  = rollout correction (token_tis / seq_mis) of the rollout engine's log-probs
    rewards  = token_level_scores [− β·KL] [+ c·(log π_teacher − log π)]
    advantages, returns = estimator(batch)
    critic.update(value loss); policy.update(policy loss); sync the rollout's weights
    metrics  = step_metrics(batch), averaged over ranks; validate; checkpoint

Orchestration only: every equation lives in ``ops`` / ``algos``, the parts are built by
``otbrl.run.build`` from the ``Plan`` (``otbrl.run.plan``), persistence is ``otbrl.store`` and
the metrics log ``otbrl.report``.

Under ``torchrun`` every rank runs this same loop. The ``World`` deals each data-parallel rank
a contiguous share of the step's prompts; all ``rollout.n`` responses of a prompt are
generated and trained on the rank that owns it, so group-relative estimators (GRPO, RLOO,
OTB) compute exactly the one-process advantages locally. Only rank 0 prints and writes the run
directory; checkpoints are collective and resume on any engine and world size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

from torch import Tensor

from otbrl.algos.advantages import compute_advantage
from otbrl.algos.loss_math import kl_in_reward
from otbrl.algos.metrics import step_metrics
from otbrl.algos.reductions import masked_mean
from otbrl.algos.rollout_correction import rollout_is_weights, rollout_mismatch_metrics
from otbrl.config import Config, to_dict
from otbrl.data import pad_token_id
from otbrl.engine.engine import NumericsError
from otbrl.engine.memory import peak_memory_gb, reset_peak_memory, state_memory
from otbrl.engine.world import collective_guard, start_world, teardown_distributed
from otbrl.report.metrics_log import MetricsLogger
from otbrl.report.plots import plot_run
from otbrl.run.announce import interrupted_line, say, startup_lines
from otbrl.run.build import build_run, model_path, scoring, sync_rollout
from otbrl.run.evaluate import validate
from otbrl.run.plan import Plan, plan_run
from otbrl.run.producer import Produced, Producer, version_metrics
from otbrl.run.rundir import RunDir, claim_run_dir
from otbrl.run.sampling import merge_groups, sample_batch, signal_groups, untrain_groups
from otbrl.run.seeds import seed_everything, step_seed
from otbrl.store import checkpoint

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
            self._build(cfg, plan)
        except BaseException:
            self.run.release()
            raise

    def _build(self, cfg: Config, plan: Plan) -> None:
        self.cfg, self.plan, self.spec = cfg, plan, plan.spec
        # Before the process group exists: every rank takes the warm-start cache's lock, the
        # first builds it and the others wait there, not in a collective that would time out.
        path = model_path(cfg)
        self.world = start_world(plan.spec.dims, timeout_s=cfg.trainer.dist_timeout_s)
        seed_everything(cfg.trainer.seed)
        self.output_dir = Path(cfg.trainer.output_dir)
        self.ckpt_root = self.output_dir / "checkpoints"
        parts = build_run(cfg, plan, self.world, path)
        self.tokenizer, self.eos_ids, self.dataset = parts.tokenizer, parts.eos_ids, parts.dataset
        self.rollout, self.sampler = parts.backend, parts.sampler
        self.engines, self.reference = parts.engines, parts.reference
        self.teacher = parts.teacher
        self.policy_loss, self.critic_loss = parts.policy_loss, parts.critic_loss
        self.scoring = scoring(cfg, plan, parts.reward_model, pool=True)
        self.step = 0
        self._memory_logged = False  # memory/params_gb and optimizer_gb: with the first step
        self.producer: Producer | None = None  # trainer.max_staleness > 0: started by fit()
        self._data_state = None  # the data state after the last batch trained on (producer)
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
    def sample(self, step: int | None = None, *, agree: bool = True):
        """This rank's share of the next prompts, ``rollout.n`` responses each, seeded by
        ``step`` (default: the current one); its scores may still be on their way
        (``sample.resolve()`` waits for them). Under dynamic sampling, the groups with signal
        of as many rounds as it takes (``_sample_with_signal``; ``agree``: the ranks agree on
        the number of rounds, which a sampler that is collective needs)."""
        step = self.step if step is None else step
        if self.spec.max_sample_rounds is not None:
            return self._sample_with_signal(step, agree)
        return self._sample_round(step, 0)

    def _sample_with_signal(self, step: int, agree: bool):
        """DAPO's dynamic sampling: rounds of this rank's share of the next prompts until it
        holds that many groups whose rewards are not all equal (with ``agree``, until every
        rank does: each round is sampled on every rank), at most ``max_sample_rounds``; a share
        still short then is filled with the latest groups without signal, whose
        ``response_mask`` is all 0: the step keeps its size on every rank and trains on the
        groups with signal alone (no policy-gradient, entropy or KL term acts on a filled row,
        and the loss counts its tokens nowhere). Groups found beyond the share are dropped,
        never trained."""
        quota = self.cfg.data.train_batch_size // self.world.dp_size
        n, found, signal = self.spec.sampling.n, 0, 0
        rounds: list = []  # per round: (its sample, the groups taken from it, the others)
        while len(rounds) < self.spec.max_sample_rounds:
            if rounds:
                self.rollout.wake_up()  # the round before put it to sleep
            sample = self._sample_round(step, len(rounds)).resolve()
            groups = signal_groups(sample, n)
            signal += len(groups)
            take = groups[: quota - found]
            found += len(take)
            others = sorted(set(range(len(sample.prompt_ids))) - set(groups))
            rounds.append((sample, take, others))
            short = found < quota
            if agree and self.world.dp_size > 1:
                short = self.world.sum([float(short)], over="dp")[0] > 0
            if not short:
                break
        filled = 0
        for _, take, others in reversed(rounds):  # the latest groups without signal first
            extra = others[: quota - found - filled]
            take += extra
            filled += len(extra)
        merged = merge_groups(
            [(sample, sorted(take)) for sample, take, _ in rounds],
            n,
            pad_id=pad_token_id(self.tokenizer),
            uid_offset=self.world.dp_rank * quota,
        )
        # the filled groups are the merged batch's groups without signal (the rest have it)
        silent = set(range(len(merged.prompt_ids))) - set(signal_groups(merged, n))
        untrain_groups(merged.batch, sorted(silent), n)
        generated = len(rounds) * quota
        merged.metrics.update(
            {
                "dynamic_sampling/rounds": float(len(rounds)),
                "dynamic_sampling/kept_frac": signal / generated,
                "dynamic_sampling/filled_frac": filled / quota,
                "dynamic_sampling/samples_per_trained": generated / quota,
            }
        )
        return merged

    def _sample_round(self, step: int, round_: int):
        """One round of sampling: this rank's share of the next prompts, seeded by ``step``
        and the round; scores may still be on their way."""
        rows = self.world.shard(self.dataset.next_batch())
        params = dataclasses.replace(
            self.spec.sampling,
            stop_token_ids=tuple(self.eos_ids),
            seed=step_seed(self.cfg.trainer.seed, step, self.world.dp_rank, round_),
        )
        sample = sample_batch(
            self.sampler,
            self.tokenizer,
            rows,
            params,
            scoring=self.scoring,
            max_prompt_length=self.spec.max_prompt_length,
            overlong=self.spec.overlong,
            uid_offset=self.world.dp_rank * len(rows),  # the global prompt index
            defer=True,  # scored (in reward.workers processes) during the policy's forward
        )
        self.rollout.sleep()  # frees the backend's memory for training, where supported
        return sample

    def _produce(self, index: int) -> Produced:
        """Batch ``index`` of the producer (its thread): sampled, scored, with the data
        stream's state after its rows were drawn."""
        sample = self.sample(step=index, agree=False)  # servers: no collective sampling
        state = self.dataset.state_dict()
        return Produced(index, state, sample.resolve())

    def _take_sample(self, metrics: dict) -> object:
        """The step's sample: sampled now (synchronous), or the producer's next fresh batch
        (``trainer.max_staleness`` > 0, its ``async/*`` and wait timings into ``metrics``)."""
        if self.producer is None:
            return self.sample()
        item, extra = self.producer.take()
        metrics.update(extra)
        self._data_state = item.data_state
        return item.sample

    def statistics(self, batch: dict[str, Tensor], timing: dict) -> None:
        """Each engine's share of the plan's needs, from one forward of the sampled batch."""
        engines = {**self.engines, "reference": self.reference, "teacher": self.teacher}
        for name, key in TIMING.items():
            outputs = self.spec.outputs(name)
            if outputs:
                with _timed(timing, key):
                    stats = engines[name].compute(batch, outputs)
                batch.update(self.spec.batch_stats(name, stats))

    def rollout_correction(self, batch: dict[str, Tensor]) -> dict[str, float]:
        """How far the rollout engine's log-probs are from the trainer's, and (with
        ``algorithm.rollout_correction`` or ``algorithm.off_policy``) the importance weights
        that correct for it: they reach the policy loss and OTB's energy W as
        ``rollout_is_weights``; ``seq_mis`` drops the sequences outside the band from
        ``response_mask``. ``old_log_probs`` is π_prox: computed once before the update."""
        mode = self.spec.correction
        old, rollout, mask = (
            batch["old_log_probs"],
            batch["rollout_log_probs"],
            batch["response_mask"],
        )
        metrics = rollout_mismatch_metrics(old, rollout, mask)
        if mode != "none":
            weights, keep, extra = rollout_is_weights(
                old, rollout, mask, mode=mode, cap=self.spec.correction_cap
            )
            batch["rollout_is_weights"] = weights
            batch["response_mask"] = mask * keep
            metrics.update(extra)
        return metrics

    def advantage(self, batch: dict[str, Tensor]) -> dict[str, float]:
        """Token rewards (minus the in-reward KL when on, plus the distillation signal when a
        teacher is set), then the registry's estimator."""
        metrics = {}
        rewards = batch["token_level_scores"]
        if self.spec.distill_coef is not None and not self.spec.distill_task_reward:
            rewards = rewards.new_zeros(rewards.shape)  # still scored: reward/* is logged
        if self.spec.kl_in_reward_coef is not None:
            rewards, kl = kl_in_reward(
                rewards,
                batch["old_log_probs"],
                batch["ref_log_probs"],
                batch["response_mask"],
                coef=self.spec.kl_in_reward_coef,
            )
            metrics["train/kl_in_reward"] = float(kl)
        if self.spec.distill_coef is not None:
            rewards, distill = self._distill(rewards, batch)
            metrics.update(distill)
        batch["token_level_rewards"] = rewards
        batch["advantages"], batch["returns"] = compute_advantage(
            self.spec.estimator, **batch, index=batch["uid"], **self.spec.estimator_options
        )
        metrics["train/advantage_mean"] = float(
            masked_mean(batch["advantages"], batch["response_mask"])
        )
        return metrics

    def _distill(self, rewards: Tensor, batch: dict[str, Tensor]) -> tuple[Tensor, dict]:
        """``rewards`` + coef·(log π_teacher − log π) on the response tokens ``[B, L]``, and the
        distillation metrics. It is the in-reward KL's equation with the teacher in the
        reference's place: the k1 estimate of the per-token reverse KL, log π − log π_teacher,
        of the policy that is about to be updated (π: ``old_log_probs``, the trainer's own
        numerics — a teacher equal to the policy gives exactly 0)."""
        mask = batch["response_mask"]
        rewards, reverse_kl = kl_in_reward(
            rewards,
            batch["old_log_probs"],
            batch["teacher_log_probs"],
            mask,
            coef=self.spec.distill_coef,
        )
        teacher = masked_mean(batch["teacher_log_probs"], mask)
        return rewards, {
            "distill/reverse_kl": float(reverse_kl),
            "distill/teacher_log_prob": float(teacher),
        }

    def train_step(self) -> dict[str, float]:
        """One full RL step on every rank; returns its metrics (reduced over ranks)."""
        with collective_guard(f"training step {self.step}"):
            timing: dict[str, float] = {}
            reset_peak_memory(self.world.device)
            start = time.perf_counter()
            sample = self._take_sample(timing)  # its scores may still be on their way
            batch = sample.batch
            self.statistics(batch, timing)
            sample = sample.resolve()  # token_level_scores; timing/rollout, timing/reward
            metrics = dict(sample.metrics)
            if self.producer is None and "policy_version" in batch:
                metrics.update(version_metrics(batch, self.rollout.weight_version))
            metrics.update(self.rollout_correction(batch))
            with _timed(timing, "adv"):
                metrics.update(self.advantage(batch))
            with _timed(timing, "update"):
                if self.critic_loss is not None:
                    metrics.update(self.engines["critic"].update(batch, self.critic_loss))
                metrics.update(self.policy.update(batch, self.policy_loss))
                self._sync_rollout_weights()
            metrics.update(
                step_metrics(
                    batch,
                    grad_norm=metrics["policy/grad_norm"],
                    response_space=self.spec.estimator == "tir_optimal_token_baseline",
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
                frozen = [e for e in (self.reference, self.teacher) if e is not None]
                metrics.update(state_memory([*self.engines.values(), *frozen]))
                self._memory_logged = True
            return self.world.mean_metrics(metrics)

    def _sync_rollout_weights(self) -> None:
        """Stream the trained weights into the rollout backend (collective on several
        processes; nothing to do when it samples with the training model itself)."""
        self.rollout.wake_up()
        sync_rollout(self.rollout, self.policy)
        if self.producer is not None:
            self.producer.notify()

    def validate(self, with_tools: bool = True, logger=None) -> dict[str, float]:
        """``val/*`` on the validation rows (greedy unless ``trainer.val_greedy=false``), sampled
        as training samples (through the agent loop when tools are configured, unless
        ``with_tools`` is false: the same policy answering alone). With a ``logger`` the first
        ``trainer.log_generations`` samples go to its generations log."""
        result = validate(
            self.sampler if with_tools else self.rollout,
            self.tokenizer,
            self.plan.val_rows,
            self.spec,
            world=self.world,
            stop_token_ids=self.eos_ids,
            seed=step_seed(self.cfg.trainer.seed, self.step),
            scoring=self.scoring.for_validation(),
            generations=self.cfg.trainer.log_generations if logger is not None else 0,
        )
        if logger is not None and result.generations:
            logger.log_generations(self.step, result.generations)
        return result.metrics

    # -- checkpoints ------------------------------------------------------------------------------
    def _resume(self) -> None:
        """From the checkpoint ``claim_run_dir`` chose and verified before any model loaded
        (rank 0 decides; the other ranks get its choice)."""
        path = self.run.resume_from if self.world.is_main else None
        path = self.world.broadcast_object(None if path is None else str(path))
        if path is None:
            if self.spec.rollout_mode == "server":  # a user's server may hold other weights
                self._sync_rollout_weights()
            return
        state = checkpoint.load_checkpoint(Path(path), engines=self.engines, verify=False)
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
            "dataset": self.dataset.state_dict() if self.producer is None else self._data_state,
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
            if self.producer is not None:
                self.producer.close()  # before the servers go
            self.rollout.close()  # before the process group goes: a vLLM engine holds groups
            if self.scoring.pool is not None:
                self.scoring.pool.close()
            if self.world.mesh is not None:  # only the group this run created
                teardown_distributed()
            self.run.release()

    def _fit(self) -> dict:
        cfg = self.cfg.trainer
        self._fit_start = time.perf_counter()
        self._resume()
        if cfg.max_staleness > 0:  # a fresh queue, also after a resume
            self._data_state = self.dataset.state_dict()
            self.producer = Producer(
                self._produce,
                lambda: self.rollout.weight_version,
                max_staleness=cfg.max_staleness,
                stale_samples=self.spec.stale_samples,
                first=self.step + 1,
            )
        if self.world.is_main:
            for line in startup_lines(
                self.cfg.trainer,
                notes=self.plan.notes,
                engines=self.engines.values(),
                ckpt_root=self.ckpt_root,
                output_dir=self.output_dir,
                step=self.step,
            ):
                say(line)
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
        validating = cfg.val_every > 0 and bool(self.plan.val_rows)
        summary: dict = {}
        try:
            if validating and self.step == 0:
                self.initial_val = self.last_val = self.validate(logger=logger)
                self.initial_val_accuracy = self.last_val_accuracy = self.last_val["val/accuracy"]
                log(0, dict(self.last_val))
            while self.step < cfg.total_steps:
                self.step += 1
                metrics = self.train_step()
                elapsed = time.perf_counter() - self._fit_start
                # every rank stops at the same step: rank clocks differ, the vote does not
                out_of_time = self.world.sum([0 < cfg.max_wall_seconds <= elapsed])[0] > 0
                last = self.step == cfg.total_steps or out_of_time
                if validating and (self.step % cfg.val_every == 0 or last):
                    start = time.perf_counter()
                    self.last_val = self.validate(logger=logger)
                    self.last_val_accuracy = self.last_val["val/accuracy"]
                    metrics.update(self.last_val)
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

    def _tool_summary(self) -> dict:
        """The tool-call rates at the start and end, and the final policy's accuracy with the
        tools taken away (what the tools are worth to it)."""
        return {
            "initial_val_tool_call_rate": self.initial_val.get("val/tool_call_rate"),
            "final_val_tool_call_rate": self.last_val.get("val/tool_call_rate"),
            "final_val_accuracy_without_tools": self.validate(with_tools=False)["val/accuracy"],
        }
