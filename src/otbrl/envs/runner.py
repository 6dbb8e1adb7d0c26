"""Calling an environment's methods from the agent loop's event loop: plain or ``async``, each
under a timeout, every failure an ``EnvError``.

A plain method runs on a daemon worker thread, so one that hangs keeps its thread (Python
cannot stop it) but never the loop, the other samples or the interpreter's exit; an ``async``
method is awaited and cancelled at its timeout. Workers are reused from call to call (starting a
thread per call cost ~1 ms, more than a game's whole step): one that is still running a call past
its timeout is simply not given another, and a new worker starts when none is free. At most
``max_hung`` calls past their timeout may still be running at once: beyond that new calls fail
at once (an environment that hangs for good cannot pile up threads for the rest of a run).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import queue
import threading

from otbrl.envs.protocol import EnvError

logger = logging.getLogger(__name__)


class EnvRunner:
    """Runs environment calls under ``timeout_s`` (seconds > 0) on the running event loop."""

    def __init__(self, timeout_s: float, *, max_hung: int = 64):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0:
            raise ValueError(f"timeout_s: expected a number of seconds > 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.max_hung = max_hung
        self._workers = _Workers()

    @property
    def threads_started(self) -> int:
        """Worker threads started so far (they are reused: a count, not a gauge)."""
        return self._workers.started

    async def call(self, what: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``'s result (awaited when it is awaitable); ``EnvError`` naming
        ``what`` when it raises or runs past the timeout."""
        hung = self._workers.hung()
        if hung >= self.max_hung:
            raise EnvError(
                f"{what}: not run: {hung} earlier environment calls still run past their "
                f"{self.timeout_s:g} s timeout"
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        try:
            if inspect.iscoroutinefunction(fn):
                result = fn(*args, **kwargs)
            else:
                job = self._workers.submit(loop, fn, args, kwargs)
                try:
                    result = await asyncio.wait_for(asyncio.shield(job.future), self.timeout_s)
                except TimeoutError:
                    self._workers.abandon(job)
                    raise
            if inspect.isawaitable(result):
                result = await asyncio.wait_for(result, max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise EnvError(f"{what} did not return within {self.timeout_s:g} s") from None
        except EnvError:
            raise
        except Exception as err:  # the environment's own failure: its sample's, not the run's
            raise EnvError(f"{what} raised {type(err).__name__}: {err}") from None
        return result


class _Job:
    """One plain call handed to a worker: its future on the caller's loop, and whether the
    caller gave up on it (its worker is then counted as hung until the call returns)."""

    def __init__(self, loop, fn, args, kwargs):
        self.loop, self.fn, self.args, self.kwargs = loop, fn, args, kwargs
        self.future: asyncio.Future = loop.create_future()
        self.abandoned = False


class _Workers:
    """Daemon threads that take jobs from one queue; a new one starts when none is idle."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._hung = 0
        self.started = 0  # worker threads started so far

    def hung(self) -> int:
        """Calls the caller gave up on that still run."""
        with self._lock:
            return self._hung

    def submit(self, loop, fn, args, kwargs) -> _Job:
        job = _Job(loop, fn, args, kwargs)
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1
        if start:
            self.started += 1
            threading.Thread(target=self._work, name="otbrl-env", daemon=True).start()
        self._jobs.put(job)
        return job

    def abandon(self, job: _Job) -> None:
        with self._lock:
            job.abandoned = True
            self._hung += 1

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                value, ok = job.fn(*job.args, **job.kwargs), True
            except Exception as err:
                value, ok = err, False
            except BaseException as err:  # a SystemExit in an env must not end the process
                value, ok = RuntimeError(f"{type(err).__name__}: {err}"), False
            with self._lock:
                if job.abandoned:
                    self._hung -= 1
                self._idle += 1
            # a closed caller's loop (RuntimeError): nobody waits for the result
            with contextlib.suppress(RuntimeError):
                job.loop.call_soon_threadsafe(_settle, job.future, ok, value)


def _settle(future: asyncio.Future, ok: bool, value) -> None:
    if not future.done():
        (future.set_result if ok else future.set_exception)(value)
