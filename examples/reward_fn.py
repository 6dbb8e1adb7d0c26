"""A user reward function, loaded with ``reward.function=examples/reward_fn.py:partial_credit``.

Signature: ``fn(data_source, solution_str, ground_truth, extra_info) -> float`` (or a dict with a
``"score"`` entry). An exception here is reported with the sample index and this function's
name; ``reward.on_error=zero`` scores such a sample 0 and counts it in ``reward/errors``.
"""


def partial_credit(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict
) -> float:
    """1.0 for the exact answer, else the fraction of leading characters that match."""
    answer, truth = solution_str.strip(), ground_truth.strip()
    if answer == truth:
        return 1.0
    same = 0
    for a, b in zip(answer, truth):
        if a != b:
            break
        same += 1
    return 0.5 * same / max(len(truth), 1)
