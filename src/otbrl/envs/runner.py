"""Calling an environment's methods from the agent loop's event loop: plain or ``async``, each
under a timeout, every failure an ``EnvError``.

A plain method runs in a daemon thread of its own, so one that hangs keeps its thread (Python
cannot stop it) but never the loop, the other samples or the interpreter's exit; an ``async``
method is awaited and cancelled at its timeout. At most ``max_hung`` calls past their timeout
may still be running at once: beyond that new calls fail at once (an environment that hangs for
good cannot pile up threads for the rest of a run).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
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
        self._hung: list[threading.Thread] = []

    async def call(self, what: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``'s result (awaited when it is awaitable); ``EnvError`` naming
        ``what`` when it raises or runs past the timeout."""
        self._hung = [t for t in self._hung if t.is_alive()]
        if len(self._hung) >= self.max_hung:
            raise EnvError(
                f"{what}: not run: {len(self._hung)} earlier environment calls still run past "
                f"their {self.timeout_s:g} s timeout"
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        try:
            if inspect.iscoroutinefunction(fn):
                result = fn(*args, **kwargs)
            else:
                result = await asyncio.wait_for(self._in_thread(fn, args, kwargs), self.timeout_s)
            if inspect.isawaitable(result):
                result = await asyncio.wait_for(result, max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise EnvError(f"{what} did not return within {self.timeout_s:g} s") from None
        except EnvError:
            raise
        except Exception as err:  # the environment's own failure: its sample's, not the run's
            raise EnvError(f"{what} raised {type(err).__name__}: {err}") from None
        return result

    def _in_thread(self, fn, args, kwargs) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(ok: bool, value) -> None:
            if not future.done():
                (future.set_result if ok else future.set_exception)(value)

        def work() -> None:
            try:
                value, ok = fn(*args, **kwargs), True
            except Exception as err:
                value, ok = err, False
            except BaseException as err:  # a SystemExit in an env must not end the process
                value, ok = RuntimeError(f"{type(err).__name__}: {err}"), False
            if not loop.is_closed():
                loop.call_soon_threadsafe(settle, ok, value)

        thread = threading.Thread(target=work, name="otbrl-env", daemon=True)
        thread.start()

        def note_hung(done: asyncio.Future) -> None:
            if done.cancelled() and thread.is_alive():
                self._hung.append(thread)

        future.add_done_callback(note_hung)
        return future
