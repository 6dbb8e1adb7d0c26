"""Where the trainer's batches come from: a ``BatchSource`` hands the trainer its next batch
(``source.next(step)``) and brings the rollout up to date when the policy's weights change
(``source.sync_weights(model)``). How the batch was made is the source's business:

- ``SyncSource``: sampled now, one round of this rank's share of the next prompts;
- ``DynamicSampling``: DAPO's dynamic sampling — rounds until the share holds enough groups
  with signal (over a ``Rounds`` it drives);
- ``AsyncSource``: a background producer samples ahead of training, up to ``max_staleness``
  weight updates old (``otbrl.run.producer``), over any other source.

Each owns its data position (``state_dict``, what a checkpoint saves: the data stream after the
last batch handed out) and its rank agreement. All sample through ``Rounds.sample``, the one
sampling step (``otbrl.run.sampling.sample_batch``). A new kind of source (environments, a
remote rollout fleet) is a class with these five methods: the trainer does not change.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from torch import nn

from otbrl.data import pad_token_id
from otbrl.rollout import RolloutBackend, Sampler, SamplingParams, sync_from
from otbrl.run.announce import say
from otbrl.run.producer import Produced, Producer, version_metrics
from otbrl.run.sampling import (
    Sample,
    Scoring,
    merge_groups,
    sample_batch,
    signal_groups,
    untrain_groups,
)
from otbrl.run.seeds import step_seed


class BatchSource(Protocol):
    """What the trainer asks for batches."""

    def next(self, step: int) -> Sample:
        """This rank's batch of ``step`` (its scores may still be on their way:
        ``sample.resolve()`` waits for them), with the source's own metrics in
        ``sample.metrics``. Collective where the source's sampling is."""
        ...

    def sync_weights(self, model: nn.Module) -> None:
        """The policy's weights changed (``model``, the trained one): bring whatever samples up
        to date. Collective on several processes."""
        ...

    def state_dict(self) -> Any:
        """The data position a checkpoint saves: the data stream after the last batch handed
        out (``next``)."""
        ...

    def load_state_dict(self, state: Any) -> None:
        """Resume at a position ``state_dict`` returned, before the first ``next``."""
        ...

    def close(self) -> None:
        """Stop what the source runs (a producer thread); the rollout backend stays."""
        ...


@dataclasses.dataclass
class Rounds:
    """One round of sampling: this rank's share of the next prompts of ``dataset``, sampled by
    ``sampler`` (the ``rollout`` backend, or the agent loop over it) as ``params`` says and
    scored by ``scoring``. ``quota``: prompts per round on this rank (whole groups); ``seed``:
    the run's, from which every round's sampling seed is derived (``step_seed``)."""

    sampler: Sampler
    rollout: RolloutBackend
    tokenizer: Any
    dataset: Any
    scoring: Scoring
    world: Any
    params: SamplingParams
    stop_token_ids: tuple[int, ...]
    seed: int
    quota: int
    max_prompt_length: int
    overlong: str

    def sample(self, step: int, round_: int = 0) -> Sample:
        """One round, seeded by ``step`` and ``round_``; scores may still be on their way. The
        rollout sleeps afterwards (frees its memory for training, where supported)."""
        rows = self.world.shard(self.dataset.next_batch())
        params = dataclasses.replace(
            self.params,
            stop_token_ids=self.stop_token_ids,
            seed=step_seed(self.seed, step, self.world.dp_rank, round_),
        )
        sample = sample_batch(
            self.sampler,
            self.tokenizer,
            rows,
            params,
            scoring=self.scoring,
            max_prompt_length=self.max_prompt_length,
            overlong=self.overlong,
            uid_offset=self.world.dp_rank * len(rows),  # the global prompt index
            defer=True,  # scored (in reward.workers processes) during the policy's forward
        )
        self.rollout.sleep()
        return sample

    def sync_weights(self, model: nn.Module) -> None:
        """Stream ``model``'s weights into the rollout (``otbrl.rollout.sync_from``)."""
        self.rollout.wake_up()
        sync_from(self.rollout, model)

    def versioned(self, sample: Sample) -> Sample:
        """``sample`` with ``async/staleness_*`` in its metrics when its rows record the weight
        version that sampled them (server backend), against the rollout's current one."""
        if "policy_version" in sample.batch:
            sample.metrics.update(version_metrics(sample.batch, self.rollout.weight_version))
        return sample


class SyncSource:
    """Each step's batch sampled when the trainer asks: one round."""

    def __init__(self, rounds: Rounds):
        self.rounds = rounds

    def next(self, step: int) -> Sample:
        """``batch(step)``, with the staleness metrics of a server backend's rows
        (``Rounds.versioned``: 0 here, but for partial rollouts)."""
        return self.rounds.versioned(self.batch(step))

    def batch(self, step: int) -> Sample:
        """One round of ``step``'s prompts."""
        return self.rounds.sample(step)

    def sync_weights(self, model: nn.Module) -> None:
        """Stream the new weights into the rollout."""
        self.rounds.sync_weights(model)

    def state_dict(self) -> Any:
        """The data stream's position."""
        return self.rounds.dataset.state_dict()

    def load_state_dict(self, state: Any) -> None:
        """Resume the data stream there."""
        self.rounds.dataset.load_state_dict(state)

    def close(self) -> None:
        """Nothing runs on its own."""


class DynamicSampling(SyncSource):
    """DAPO's dynamic sampling: rounds of this rank's share of the next prompts until it holds
    ``quota`` groups whose rewards are not all equal, at most ``max_rounds``.

    ``agree``: every rank samples until every rank has its share (each round is collective when
    the sampler is: the ranks agree on the number of rounds); off under a producer, whose
    servers sample each rank alone. A share still short after the last round is filled with
    the latest groups without signal, whose ``response_mask`` is all 0: the step keeps its size
    on every rank and trains on the groups with signal alone (no policy-gradient, entropy or KL
    term acts on a filled row, and the loss counts its tokens nowhere). Groups found beyond the
    share are dropped, never trained.
    """

    def __init__(self, rounds: Rounds, *, max_rounds: int, agree: bool):
        super().__init__(rounds)
        self.max_rounds, self.agree = max_rounds, agree
        self._said_silent = False  # a step that trains nothing is said once, on rank 0

    def batch(self, step: int) -> Sample:
        """The groups with signal of as many rounds as it takes, filled up if short, with
        ``dynamic_sampling/*`` metrics (rounds, kept and filled fractions)."""
        world, quota = self.rounds.world, self.rounds.quota
        n, found, signal = self.rounds.params.n, 0, 0
        picked: list = []  # per round: (its sample, the groups taken from it, the others)
        while len(picked) < self.max_rounds:
            if picked:
                self.rounds.rollout.wake_up()  # the round before put it to sleep
            sample = self.rounds.sample(step, len(picked)).resolve()
            groups = signal_groups(sample, n)
            signal += len(groups)
            take = groups[: quota - found]
            found += len(take)
            others = sorted(set(range(len(sample.prompt_ids))) - set(groups))
            picked.append((sample, take, others))
            short = found < quota
            if self.agree and world.dp_size > 1:
                short = world.sum([float(short)], over="dp")[0] > 0
            if not short:
                break
        filled = 0
        for _, take, others in reversed(picked):  # the latest groups without signal first
            extra = others[: quota - found - filled]
            take += extra
            filled += len(extra)
        merged = merge_groups(
            [(sample, sorted(take)) for sample, take, _ in picked],
            n,
            pad_id=pad_token_id(self.rounds.tokenizer),
            uid_offset=world.dp_rank * quota,
        )
        # the filled groups are the merged batch's groups without signal (the rest have it)
        silent = set(range(len(merged.prompt_ids))) - set(signal_groups(merged, n))
        untrain_groups(merged.batch, sorted(silent), n)
        generated = len(picked) * quota
        if signal == 0:
            self._say_silent(step, len(picked))
        merged.metrics.update(
            {
                "dynamic_sampling/rounds": float(len(picked)),
                "dynamic_sampling/kept_frac": signal / generated,
                "dynamic_sampling/filled_frac": filled / quota,
                "dynamic_sampling/samples_per_trained": generated / quota,
            }
        )
        return merged

    def _say_silent(self, step: int, rounds: int) -> None:
        """One line, the first time a step of this rank 0 trains nothing (grad norm 0): what
        happened and what to change; later ones show in ``dynamic_sampling/filled_frac``."""
        if self._said_silent or not self.rounds.world.is_main:
            return
        self._said_silent = True
        say(
            f"dynamic sampling: step {step} found no group whose rewards differ in {rounds} "
            f"round(s) of {self.rounds.quota} prompts, so it trains nothing; raise "
            "algorithm.max_sample_rounds, or check that the reward tells responses apart (one "
            "that scores every response alike never trains). Later steps like it show as "
            "dynamic_sampling/filled_frac = 1 in the metrics, not here"
        )


class AsyncSource:
    """Asynchronous RL (``trainer.max_staleness`` = k > 0): a ``Producer`` thread samples and
    scores the batches of ``inner`` (``inner.batch``: a source that agrees with no other rank)
    ahead of training; ``next`` takes the next one fresh enough (``rollout.stale_samples``: wait
    or drop), with the step's ``async/*`` metrics (staleness when it is taken) and wait
    timings. The producer starts at the first ``next`` (after a resume: at the resumed step); a
    checkpoint saves the data position after the last batch trained on, so a resumed run
    redraws exactly the batches the killed one had queued."""

    def __init__(self, inner: SyncSource, *, max_staleness: int, stale_samples: str):
        self.inner = inner
        self.max_staleness, self.stale_samples = max_staleness, stale_samples
        self.producer: Producer | None = None
        self._data_state: Any = None  # after the last batch handed out (or the start)

    def _produce(self, index: int) -> Produced:
        """Batch ``index`` (the producer's thread): sampled, scored, with the data stream's
        state after its rows were drawn."""
        sample = self.inner.batch(index)
        state = self.inner.state_dict()
        return Produced(index, state, sample.resolve())

    def next(self, step: int) -> Sample:
        """The producer's next fresh batch (it starts with batch ``step``)."""
        rollout = self.inner.rounds.rollout
        if self.producer is None:
            self._data_state = self.inner.state_dict()
            self.producer = Producer(
                self._produce,
                lambda: rollout.weight_version,
                max_staleness=self.max_staleness,
                stale_samples=self.stale_samples,
                first=step,
            )
        item, extra = self.producer.take()
        self._data_state = item.data_state
        item.sample.metrics.update(extra)
        return item.sample

    def sync_weights(self, model: nn.Module) -> None:
        """Stream the new weights into the servers, then wake a producer waiting for them."""
        self.inner.sync_weights(model)
        if self.producer is not None:
            self.producer.notify()

    def state_dict(self) -> Any:
        """The data position after the last batch handed out (not the producer's, ahead)."""
        return self.inner.state_dict() if self._data_state is None else self._data_state

    def load_state_dict(self, state: Any) -> None:
        """Resume the data stream there (before the producer starts)."""
        self.inner.load_state_dict(state)
        self._data_state = self.inner.state_dict()

    def close(self) -> None:
        """Stop the producer thread (before the rollout's servers go)."""
        if self.producer is not None:
            self.producer.close()
