"""The producer of asynchronous RL (``otbrl.run.producer``) with random generation and training
delays: the staleness bound k is never exceeded on a trained batch, it is reached (the
producer really runs ahead), ``wait`` trains every batch in order, ``drop`` counts what it
drops, and a failure in the producer reaches the trainer."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from otbrl.run.producer import Produced, Producer
from otbrl.run.sampling import Sample


class FakeRollout:
    """A weight-version counter, and batches stamped with the version at their start."""

    def __init__(self, rng: random.Random, groups: int = 2, n: int = 2):
        self.version = 0
        self.rng, self.groups, self.n = rng, groups, n
        self.lock = threading.Lock()

    def produce(self, index: int) -> Produced:
        with self.lock:
            version = self.version
        time.sleep(self.rng.uniform(0.0, 0.01))  # generation
        b = self.groups * self.n
        batch = {
            "policy_version": torch.full((b,), version, dtype=torch.int64),
            "uid": torch.arange(self.groups).repeat_interleave(self.n),
        }
        return Produced(index, {"index": index}, Sample(batch, [], [], {}, []))


def _train(mode: str, k: int, steps: int, seed: int):
    rng = random.Random(seed)
    rollout = FakeRollout(rng)
    producer = Producer(rollout.produce, lambda: rollout.version, max_staleness=k,
                        stale_samples=mode)  # fmt: skip
    seen = []
    try:
        for _ in range(steps):
            item, metrics = producer.take()
            seen.append((item.index, metrics))
            assert metrics["async/staleness_max"] <= k
            current = rollout.version
            assert metrics["async/staleness_max"] == current - int(
                item.sample.batch["policy_version"].min()
            )
            time.sleep(rng.uniform(0.0, 0.01))  # the update
            with rollout.lock:
                rollout.version += 1
            producer.notify()
    finally:
        producer.close()
    return seen


@settings(max_examples=6)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 3))
def test_wait_never_exceeds_the_bound_and_trains_every_batch_in_order(seed, k):
    seen = _train("wait", k, 12, seed)
    assert [index for index, _ in seen] == list(range(1, 13))
    assert all(m["async/dropped_groups"] == 0 for _, m in seen)


@settings(max_examples=6)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 3))
def test_drop_never_trains_on_a_batch_older_than_the_bound(seed, k):
    seen = _train("drop", k, 12, seed)
    indices = [index for index, _ in seen]
    assert indices == sorted(indices) and len(set(indices)) == len(indices)
    dropped = sum(m["async/dropped_groups"] for _, m in seen)
    assert dropped == 2 * (indices[-1] - len(indices))  # 2 groups in each skipped batch


@pytest.mark.parametrize("k", [1, 2])
def test_the_producer_really_runs_ahead(k):
    """A slow trainer: the producer fills the queue, so staleness k is reached."""
    rollout = FakeRollout(random.Random(0))
    producer = Producer(rollout.produce, lambda: rollout.version, max_staleness=k,
                        stale_samples="wait")  # fmt: skip
    try:
        worst = 0
        for _ in range(3 * k + 2):
            _, metrics = producer.take()
            worst = max(worst, metrics["async/staleness_max"])
            time.sleep(0.05)
            rollout.version += 1
            producer.notify()
        assert worst == k
    finally:
        producer.close()


def test_a_producer_failure_reaches_the_trainer():
    def produce(index):
        raise RuntimeError("server down")

    producer = Producer(produce, lambda: 0, max_staleness=1, stale_samples="wait")
    with pytest.raises(RuntimeError, match="server down"):
        producer.take()
    producer.close()


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="max_staleness"):
        Producer(lambda i: None, lambda: 0, max_staleness=0, stale_samples="wait")
    with pytest.raises(ValueError, match="stale_samples"):
        Producer(lambda i: None, lambda: 0, max_staleness=1, stale_samples="skip")
