"""Weight versions per token for partial rollouts (``ServerRollout(partial_rollout=True)``).

A weight update does not wait for the requests in flight, so one completion's tokens may come
from several weight versions. Every request of ours is sent with an ``X-Request-Id`` of
:func:`new_request_id` and tracked while in flight (``InFlightRequests.track``); at an update,
its server paused, the worker extension's ``otbrl_progress`` says how many tokens each sample
has generated (the old weights' share), recorded with the version that follows
(``InFlightRequests.mark_update``). A request the worker did not hold at the update (still
queued, or finished with its answer on the way) keeps its older version: staleness can be
over-counted, never under-counted.
"""

from __future__ import annotations

import contextlib
import re
import threading
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

# vLLM's internal id of sample j of the one prompt of a /v1/completions request whose
# X-Request-Id is ours: "cmpl-<ours>-0-<8 hex>", "<j>_" in front for n > 1 (parallel sampling)
INTERNAL_ID = re.compile(r"(?:(\d+)_)?cmpl-(otbrl-[0-9a-f]{32})-0-[0-9a-f]{8}")


def new_request_id() -> str:
    """An ``X-Request-Id`` of ours (what :data:`INTERNAL_ID` finds in vLLM's ids)."""
    return f"otbrl-{uuid.uuid4().hex}"


@dataclass
class InFlight:
    """A request in flight: its server, the weight version it was sent at, and for each update
    it lived through (the new version, {sample j: tokens before})."""

    server: object
    version: int
    updates: list[tuple[int, dict[int, int]]] = field(default_factory=list)

    def token_versions(self, j: int, length: int) -> list[int]:
        """The version of each of sample j's ``length`` tokens."""
        versions = [self.version] * length
        for new, before in self.updates:
            if j in before:  # else the worker did not hold it then: keep the older version
                versions[before[j] :] = [new] * max(0, length - before[j])
        return versions


class InFlightRequests:
    """The requests of ours in flight, by ``X-Request-Id``; thread-safe."""

    def __init__(self) -> None:
        self._by_id: dict[str, InFlight] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def track(self, rid: str, server: object, version: int) -> Iterator[InFlight]:
        """``rid`` sent to ``server`` at ``version``: in flight until the block ends."""
        request = InFlight(server, version)
        with self._lock:
            self._by_id[rid] = request
        try:
            yield request
        finally:
            with self._lock:
                self._by_id.pop(rid, None)

    def mark_update(self, server: object, progress: Mapping[str, int], version: int) -> None:
        """``server`` is paused before weight ``version`` goes in; ``progress``: the tokens
        each request it holds has generated, by vLLM's internal id (``otbrl_progress``).
        Records, for every request of ours among them, where ``version`` starts."""
        before: dict[str, dict[int, int]] = {}
        for internal, count in progress.items():
            match = INTERNAL_ID.fullmatch(internal)
            if match:
                before.setdefault(match.group(2), {})[int(match.group(1) or 0)] = int(count)
        with self._lock:
            for rid, request in self._by_id.items():
                if request.server is server and rid in before:
                    request.updates.append((version, before[rid]))
