"""Built-in environments, by name (``rollout.multi_turn.env=NAME``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping


class GuessEnv:
    """Guess the row's secret (``reward_model.ground_truth``, in ``1..extra_info.high``): each
    step's action is a guess; the observation is ``+`` (the secret is higher), ``-`` (lower) or
    ``?`` (not a number in range); a right guess ends the episode with reward 1 (every other
    step rewards 0). The task of the same name (``otbrl.data.tasks.GuessTask``) makes its rows.
    """

    def __init__(self, secret: int, high: int):
        if not 1 <= secret <= high:
            raise ValueError(f"secret: expected an int in [1, {high}], got {secret}")
        self.secret, self.high = secret, high

    def reset(self, seed: int | None = None, options: dict | None = None):
        """No observation: the row's prompt opens the episode."""
        return None, {}

    def step(self, action: str):
        """``(observation, reward, terminated, truncated, info)`` for the guess ``action``."""
        text = action.strip()
        guess = int(text) if text.isdigit() and len(text) <= 6 else None
        if guess is None or not 1 <= guess <= self.high:
            return "?", 0.0, False, False, {"valid": False}
        if guess == self.secret:
            return None, 1.0, True, False, {"valid": True}
        return ("+" if self.secret > guess else "-"), 0.0, False, False, {"valid": True}


def make_guess(row: Mapping) -> GuessEnv:
    """The ``guess`` environment of a row of the ``guess`` task."""
    extra = row.get("extra_info") or {}
    return GuessEnv(int(row["reward_model"]["ground_truth"]), int(extra.get("high", 15)))


BUILTIN_ENVS: dict[str, Callable] = {"guess": make_guess}
