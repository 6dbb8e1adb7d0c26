"""A text environment in Gymnasium's own shape, for ``rollout.multi_turn.env``.

    otbrl train ... rollout.multi_turn.env=examples/guess_env.py:make

``make(row)`` builds one environment per sample from the data row; the secret comes from the
row's ground truth, so the samples of one prompt face the same task. Gymnasium's ``Env`` is the
base class, but nothing here is otbrl's: the same class runs in any Gymnasium loop.
"""

from __future__ import annotations

import gymnasium as gym
from gymnasium import spaces


class GuessNumber(gym.Env):
    """Guess a number in ``1..high``: each action is a guess in words or digits, each
    observation says whether the secret is higher or lower; a right guess ends the episode with
    reward 1, and every wrong one costs a little."""

    def __init__(self, secret: int, high: int = 100):
        self.secret, self.high = secret, high
        self.action_space = spaces.Text(max_length=256)
        self.observation_space = spaces.Text(max_length=256)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)  # seeds self.np_random, as Gymnasium asks
        return f"I am thinking of a number between 1 and {self.high}.", {}

    def step(self, action: str):
        digits = "".join(c if c.isdigit() else " " for c in action).split()
        if not digits:
            return "Please answer with a number.", -0.1, False, False, {}
        guess = int(digits[-1])  # the last number the turn wrote
        if guess == self.secret:
            return "Correct!", 1.0, True, False, {"guesses": guess}
        hint = "higher" if self.secret > guess else "lower"
        return f"{guess} is wrong: my number is {hint}.", -0.1, False, False, {}


def make(row: dict) -> GuessNumber:
    """One environment for one sample of ``row``."""
    return GuessNumber(int(row["reward_model"]["ground_truth"]), high=100)
