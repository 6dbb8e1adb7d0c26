"""The reward of reasoning-gym rows (data_source ``reasoning_gym/NAME``): the dataset's own
``score_answer`` on the row's entry (``extra_info.reasoning_gym_entry``, typed JSON written by
``otbrl.data.reasoning_gym``), the answer being the last ``<answer>...</answer>`` of the
response (reasoning-gym's own extraction), or the whole response stripped when it has none.

The scorer is the dataset built with the row's options (``extra_info.reasoning_gym_options``),
once per process: ``score_answer`` may read its dataset's config. A scorer that raises on an
answer it cannot parse (``prime_factorization`` on words, for one) scores that answer 0.0, as a
wrong answer: the model wrote it, the run goes on.
"""

from __future__ import annotations

import functools
import json
import math

SOURCE_PREFIX = "reasoning_gym/"


def reasoning_gym_score(data_source: str, solution_str: str, ground_truth, extra_info) -> float:
    """reasoning-gym's ``score_answer`` for the row's entry (module docstring); a row without
    its entry is a ``ValueError`` naming the data source."""
    from otbrl.data.reasoning_gym import decode_entry

    extra = extra_info or {}
    text = extra.get("reasoning_gym_entry")
    if not isinstance(text, str):
        raise ValueError(
            f"data_source {data_source!r}: the row has no extra_info.reasoning_gym_entry (rows "
            "of data.task=reasoning_gym:NAME or examples/make_parquet.py carry it)"
        )
    options = extra.get("reasoning_gym_options") or "{}"
    options = options if isinstance(options, str) else json.dumps(options, sort_keys=True)
    scorer = _scorer(data_source[len(SOURCE_PREFIX) :], options)
    from reasoning_gym.utils import extract_answer

    answer = extract_answer(solution_str)
    if answer is None:
        answer = solution_str.strip()
    try:
        score = float(scorer(answer, decode_entry(text)))
    except Exception:  # the scorer cannot parse what the model wrote: a wrong answer
        return 0.0
    return score if math.isfinite(score) else 0.0


@functools.lru_cache(maxsize=256)
def _scorer(name: str, options: str):
    from otbrl.data.reasoning_gym import make_dataset

    return make_dataset({name: 1.0}, {name: json.loads(options)}, size=1, seed=0).score_answer
