"""The producer of asynchronous RL (``trainer.max_staleness`` = k > 0): a background thread that
samples and scores batches ahead of training, through the same sampling step as the
synchronous loop (``otbrl.run.sampling.sample_batch``, stateless).

Versions: the rollout backend counts weight updates (``weight_version``); every sample records
the version that sampled it (``policy_version``, a multi-turn row its oldest turn's). A batch
taken while the trainer's weights are at version V has staleness V − min(policy_version) (the
number of updates between sampling and training on it).

- ``stale_samples="wait"``: batch b (1, 2, ...) is only started once the weights are at version
  ≥ v₀ + b − 1 − k (v₀: the version at the start), so it is at most k updates old when step b
  trains on it; every batch is trained on, in order.
- ``stale_samples="drop"``: the producer never waits on versions, only on a full queue (k
  batches); the trainer drops a batch older than k (its groups counted in
  ``async/dropped_groups``) and takes the next.

Resume: a batch records the data stream's state after its rows were drawn (``data_state``); a
checkpoint saves that of the last batch trained on, so the resumed run redraws exactly the
batches the killed one had queued (the queue itself is not saved: it starts fresh).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from otbrl.rollout.config import STALE_SAMPLES
from otbrl.run.sampling import Sample


@dataclass
class Produced:
    """One batch from the producer: its index b (1, 2, ...), the data stream's state after its
    rows were drawn (what a checkpoint taken after training on it saves), and the resolved
    (scored) sample."""

    index: int
    data_state: Any
    sample: Sample


class Producer:
    """Runs ``produce(b) -> Produced`` for b = first, first + 1, ... in a daemon thread.

    Args:
        produce: samples, scores and returns batch b (called in the producer thread only).
        version: the rollout's current weight version (read in both threads).
        max_staleness: k ≥ 1.
        stale_samples: ``"wait"`` or ``"drop"`` (module docstring).
        first: the index of the first batch (the trainer's next step).
    """

    def __init__(
        self,
        produce: Callable[[int], Produced],
        version: Callable[[], int],
        *,
        max_staleness: int,
        stale_samples: str,
        first: int = 1,
    ) -> None:
        if max_staleness < 1:
            raise ValueError(f"max_staleness: expected an int ≥ 1, got {max_staleness!r}")
        if stale_samples not in STALE_SAMPLES:
            raise ValueError(
                f"stale_samples: expected one of {STALE_SAMPLES}, got {stale_samples!r}"
            )
        self.produce, self.version = produce, version
        self.k, self.mode = max_staleness, stale_samples
        self.first, self.start_version = first, version()
        self.queue: queue.Queue[Produced | BaseException] = queue.Queue(maxsize=max_staleness)
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self.waited_s = 0.0  # producer time spent waiting (staleness gate, full queue)
        self._thread = threading.Thread(target=self._run, name="otbrl-producer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        index = self.first
        try:
            while not self._stop.is_set():
                start = time.perf_counter()
                if self.mode == "wait":
                    need = self.start_version + (index - self.first) - self.k
                    with self._changed:
                        while self.version() < need and not self._stop.is_set():
                            self._changed.wait(0.5)
                self.waited_s += time.perf_counter() - start
                if self._stop.is_set():
                    return
                item = self.produce(index)
                start = time.perf_counter()
                while not self._stop.is_set():
                    try:
                        self.queue.put(item, timeout=0.5)
                        break
                    except queue.Full:
                        continue
                self.waited_s += time.perf_counter() - start
                index += 1
        except BaseException as err:  # the trainer re-raises it where it takes the next batch
            self.queue.put(err)

    def notify(self) -> None:
        """The weights changed: wake a producer waiting on the staleness gate."""
        with self._changed:
            self._changed.notify_all()

    def take(self) -> tuple[Produced, dict[str, float]]:
        """The next batch fresh enough to train on (``drop``: older ones are skipped), and the
        step's ``async/*`` metrics and ``timing/trainer_wait`` / ``timing/rollout_wait``."""
        start = time.perf_counter()
        waited_before = self.waited_s
        dropped = 0
        while True:
            depth = self.queue.qsize()
            item = self.queue.get()
            if isinstance(item, BaseException):
                raise item
            metrics = version_metrics(item.sample.batch, self.version())
            if self.mode == "drop" and metrics["async/staleness_max"] > self.k:
                dropped += int(item.sample.batch["uid"].unique().numel())
                continue
            break
        metrics |= {
            "async/dropped_groups": float(dropped),
            "async/queue_depth": float(depth),
            "timing/trainer_wait": time.perf_counter() - start,
            "timing/rollout_wait": self.waited_s - waited_before,
        }
        return item, metrics

    def close(self) -> None:
        """Stop the thread (it finishes the batch it is sampling, which is then discarded)."""
        self._stop.set()
        self.notify()
        while True:  # unblock a put
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=300)


def version_metrics(batch: dict[str, Tensor], current: int) -> dict[str, float]:
    """How old a batch is when the weights are at version ``current``: ``async/staleness_mean``
    / ``_max`` over rows of current − the row's oldest version (``policy_version`` [B], or its
    row minimum when it is per token, [B, Lr]). Per-token versions (partial rollouts) add
    ``async/token_staleness_mean`` (over the trained tokens) and ``async/partial_rows_frac``
    (rows that span a weight update)."""
    versions = batch["policy_version"]
    oldest = versions if versions.dim() == 1 else versions.min(dim=1).values
    stale = current - oldest
    metrics = {
        "async/staleness_mean": float(stale.double().mean()),
        "async/staleness_max": float(stale.max()),
    }
    if versions.dim() == 2:
        mask = batch["response_mask"] > 0
        tokens = (current - versions)[mask].double()
        metrics["async/token_staleness_mean"] = float(tokens.mean()) if tokens.numel() else 0.0
        spans = versions.max(dim=1).values > oldest  # padding holds the row's newest
        metrics["async/partial_rows_frac"] = float(spans.double().mean())
    return metrics
