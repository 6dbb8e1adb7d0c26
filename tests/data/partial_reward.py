"""A dense reward for the regression test of the tool task: a cut-short warm start rarely gets
a product right, and a 0/1 reward then gives no gradient to compare."""


def digits_in_place(data_source, solution_str, ground_truth, extra_info=None):
    """Share of the answer's digits that are right in their place, + 0.25 for a tool call."""
    truth = str(ground_truth)
    hits = sum(a == b for a, b in zip(solution_str.strip(), truth))
    calls = (extra_info or {}).get("tool_calls", 0)
    return hits / max(len(truth), 1) + 0.25 * (calls > 0)
