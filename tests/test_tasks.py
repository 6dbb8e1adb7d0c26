import pytest

from otbrl.data import ARITHMETIC_SOURCE, ArithmeticTask, get_task, validate_row


def _pair(row):
    a, b = row["prompt"][0]["content"].rstrip("=").split("+")
    return int(a), int(b)


def test_splits_are_disjoint_and_cover_every_pair():
    task = get_task("arithmetic")
    train, val = task.rows("train"), task.rows("val")
    train_pairs, val_pairs = {_pair(r) for r in train}, {_pair(r) for r in val}
    assert len(train_pairs) == len(train) and len(val_pairs) == len(val) == 1000
    assert not train_pairs & val_pairs
    assert train_pairs | val_pairs == {(a, b) for a in range(10, 100) for b in range(10, 100)}


def test_splits_do_not_depend_on_the_draw_seed():
    task = get_task("arithmetic")
    val_a = {_pair(r) for r in task.rows("val", seed=1)}
    val_b = {_pair(r) for r in task.rows("val", seed=2)}
    assert val_a == val_b
    assert not val_a & {_pair(r) for r in task.rows("train", 500, seed=3)}
    # A second instance partitions identically: train/val stay disjoint across processes.
    assert {_pair(r) for r in ArithmeticTask().rows("val")} == val_a


def test_rows_are_deterministic_by_seed():
    task = get_task("arithmetic")
    assert task.rows("train", 50, seed=5) == task.rows("train", 50, seed=5)
    assert task.rows("train", 50, seed=5) != task.rows("train", 50, seed=6)


def test_rows_follow_the_schema_and_are_correct():
    task = get_task("arithmetic")
    for row in task.rows("train", 300, seed=0):
        validate_row(row)
        assert row["data_source"] == ARITHMETIC_SOURCE
        a, b = _pair(row)
        truth = row["reward_model"]["ground_truth"]
        assert isinstance(truth, str) and int(truth) == a + b
        assert task.demonstration(row) == truth
        assert len(truth) <= task.max_response_chars
        text = row["prompt"][0]["content"] + truth
        assert set(text) <= set(task.alphabet)
        assert row["extra_info"]["split"] == "train"


def test_other_digit_counts():
    task = ArithmeticTask(digits=1, n_val=20)
    rows = task.rows("val")
    assert len(rows) == 20 and task.split_size("train") == 80
    assert all(sum(_pair(r)) == int(r["reward_model"]["ground_truth"]) for r in rows)


def test_bad_arguments():
    task = get_task("arithmetic")
    with pytest.raises(ValueError, match="split"):
        task.rows("test")
    with pytest.raises(ValueError, match="n: expected"):
        task.rows("val", 1001)
    with pytest.raises(ValueError, match="n: expected"):
        task.rows("val", 0)
    with pytest.raises(ValueError, match="'chess'"):
        get_task("chess")
    with pytest.raises(ValueError, match="digits"):
        ArithmeticTask(digits=9)
    with pytest.raises(ValueError, match="n_val"):
        ArithmeticTask(digits=1, n_val=100)


def test_digit_sum_demonstrations_are_valid_and_vary_in_length():
    from otbrl.data import DIGIT_SUM_SOURCE, DigitSumTask
    from otbrl.rewards import reward_for_data_source

    task = get_task("digit_sum")
    reward = reward_for_data_source(DIGIT_SUM_SOURCE)
    rows = task.rows("train", 2000, seed=0)
    lengths_by_sum: dict[int, set[int]] = {}
    for row in rows:
        validate_row(row)
        total = int(row["reward_model"]["ground_truth"])
        demo = task.demonstration(row)
        assert demo == task.demonstration(dict(row))  # fixed per row
        assert set(demo) <= set("123456789") and sum(map(int, demo)) == total
        assert -(-total // 9) <= len(demo) <= min(total, task.max_response_chars)
        assert set(row["prompt"][0]["content"] + demo) <= set(task.alphabet)
        assert reward(DIGIT_SUM_SOURCE, demo, row["reward_model"]["ground_truth"], {}) == 1.0
        lengths_by_sum.setdefault(total, set()).add(len(demo))
    # the point of the task: one prompt, answers of many lengths
    assert lengths_by_sum[20] == set(range(3, 9))
    assert DigitSumTask(max_sum=9, max_digits=1).rows("val", 5)[0]["extra_info"]["split"] == "val"
    for bad, match in [({"max_digits": 0}, "max_digits"), ({"max_sum": 73}, "max_sum")]:
        with pytest.raises(ValueError, match=match):
            DigitSumTask(**bad)


@pytest.mark.parametrize(
    "text, truth, expected",
    [
        ("39", "12", 1.0),
        (" 111117\n", "12", 1.0),
        ("38", "12", 0.0),
        ("309", "12", 0.0),
        ("", "0", 0.0),
        ("3a9", "12", 0.0),
        ("9", "9", 1.0),
    ],
)
def test_digit_sum_reward(text, truth, expected):
    from otbrl.rewards import BUILTIN_REWARDS

    assert BUILTIN_REWARDS["digit_sum"]("otbrl/digit_sum", text, truth, {}) == expected


def test_tool_arithmetic_demonstrations_mix_calls_and_direct_answers():
    from otbrl.data.tasks import ToolArithmeticTask

    task = ToolArithmeticTask(n_train=3000, n_val=50)
    rows = task.rows("train", seed=0)
    calls = []
    for row in rows:
        validate_row(row)
        a, b = map(int, row["extra_info"]["expression"].split("*"))
        assert 1000 <= a <= 9999 and 10 <= b <= 99
        truth = row["reward_model"]["ground_truth"]
        demo = task.demonstration(row)
        assert demo == task.demonstration(row)  # fixed per row
        if isinstance(demo, str):
            assert demo == truth == str(a * b)
            calls.append(False)
            continue
        call, observation, answer = demo
        assert call["tool_calls"] == [
            {"name": "calculator", "arguments": {"expression": f"{a}*{b}"}}
        ]
        assert observation == {"role": "tool", "name": "calculator", "content": str(a * b)}
        assert answer == {"role": "assistant", "content": truth}
        calls.append(True)
    leading = [r["extra_info"]["expression"][0] in "123" for r in rows]
    # the prompts the greedy policy learns to call on always call; the others sometimes
    assert all(c for c, lead in zip(calls, leading) if lead)
    others = [c for c, lead in zip(calls, leading) if not lead]
    assert 0.17 < sum(others) / len(others) < 0.23
    never = ToolArithmeticTask(n_train=200, n_val=10, tool_leading_digits="", tool_fraction=0.0)
    assert all(isinstance(never.demonstration(r), str) for r in never.rows("train"))
    with pytest.raises(ValueError, match="tool_leading_digits"):
        ToolArithmeticTask(tool_leading_digits="0")
    with pytest.raises(ValueError, match="tool_fraction"):
        ToolArithmeticTask(tool_fraction=1.5)


def _check_chain(items: str, text: str) -> int:
    """An independent reading of a chain_sum response: every item in order, each written total
    the running sum so far (modulo 10), at most one item between totals, then
    ``####`` and the sum."""
    steps, _, answer = text.partition("####")
    labels, digits = items[0::2], [int(d) for d in items[1::2]]
    i, total = 0, 0
    for step in steps.split(";")[:-1]:
        pairs, _, written = step.partition("=")
        assert 2 <= len(pairs) <= 4 and len(pairs) % 2 == 0, step
        for k in range(0, len(pairs), 2):
            assert pairs[k] == labels[i] and int(pairs[k + 1]) == digits[i], (step, i)
            total += digits[i]
            i += 1
        assert written == str(total % 10), step
    assert steps.endswith(";") and i == len(digits) and answer == str(total % 10)
    return total % 10


def test_chain_sum_demonstrations_walk_every_item_and_vary_in_length():
    from otbrl.data import CHAIN_SUM_SOURCE, ChainSumTask
    from otbrl.rewards.builtin import DATA_SOURCE_REWARDS

    task = get_task("chain_sum")
    assert isinstance(task, ChainSumTask)
    rows = task.rows("train", 400, seed=0)
    lengths_by_items = {}
    for row in rows:
        validate_row(row)
        assert row["data_source"] == CHAIN_SUM_SOURCE
        items = row["prompt"][0]["content"].removesuffix("=")
        assert items == row["extra_info"]["items"] and 10 <= len(items) // 2 <= 26
        demo = task.demonstration(row)
        assert demo == task.demonstration(row)  # fixed per row
        assert _check_chain(items, demo) == int(row["reward_model"]["ground_truth"])
        assert set(demo) <= set(task.alphabet) and len(demo) <= task.max_response_chars
        reward = DATA_SOURCE_REWARDS[CHAIN_SUM_SOURCE]
        truth, extra = row["reward_model"]["ground_truth"], row["extra_info"]
        assert reward(CHAIN_SUM_SOURCE, demo, truth, extra) == 1.0
        wrong = demo.rsplit("####", 1)[0] + f"####{(int(truth) + 1) % 10}"
        assert reward(CHAIN_SUM_SOURCE, wrong, truth, extra) == 0.0
        lengths_by_items.setdefault(len(items) // 2, set()).add(len(demo))
    lengths = [n for seen in lengths_by_items.values() for n in seen]
    assert min(lengths) < 60 and max(lengths) > 115  # the 48-256-token regime
    # the same number of items is written at several lengths (skipped totals): a group's
    # samples can differ in length for one prompt
    assert all(len(seen) >= 3 for n, seen in lengths_by_items.items() if n >= 14)
    # the longest possible answer (every total written, the largest sum) fits the budget
    longest = "".join(f"{c}9={9 * (i + 1) % 10};" for i, c in enumerate(task.labels)) + "####4"
    assert len(longest) == task.max_response_chars


def test_chain_sum_splits_and_bad_arguments():
    from otbrl.data import ChainSumTask

    task = get_task("chain_sum")
    val = {r["extra_info"]["items"] for r in task.rows("val")}
    train = {r["extra_info"]["items"] for r in task.rows("train", 5000, seed=1)}
    assert len(val) == 1000 and not val & train
    assert {r["extra_info"]["items"] for r in ChainSumTask().rows("val")} == val
    small = ChainSumTask(min_items=2, max_items=3, skip_prob=0.0, n_train=10, n_val=5)
    for row in small.rows("val"):
        assert "####" in small.demonstration(row) and small.demonstration(row).count(";") in (2, 3)
    for kwargs, name in (
        ({"max_items": 27}, "max_items"),
        ({"min_items": 0}, "min_items"),
        ({"min_items": 9, "max_items": 8}, "min_items"),
        ({"skip_prob": 1.5}, "skip_prob"),
        ({"n_train": 0}, "n_train"),
    ):
        with pytest.raises(ValueError, match=name):
            ChainSumTask(**kwargs)


def test_chain_sum_parquet_export_reads_back(tmp_path):
    """The verl-style export (examples/make_parquet.py) reads back through otbrl's own loader,
    with the demonstrations a framework's SFT would take and the data source it scores by."""
    import subprocess
    import sys
    from pathlib import Path

    from otbrl.data import read_parquet_rows

    script = Path(__file__).resolve().parents[1] / "examples" / "make_parquet.py"
    out = tmp_path / "chain"
    subprocess.run(
        [
            sys.executable,
            script,
            "--out",
            out,
            "--task",
            "chain_sum",
            "--n-train",
            "20",
            "--n-val",
            "8",
        ],
        check=True,
        capture_output=True,
    )
    task = get_task("chain_sum")
    for split, n in (("train", 20), ("val", 8)):
        rows = read_parquet_rows(out / f"{split}.parquet")
        assert len(rows) == n
        for row in rows:
            assert row["extra_info"]["split"] == split
            truth = row["reward_model"]["ground_truth"]
            assert _check_chain(row["extra_info"]["items"], row["extra_info"]["answer"]) == int(
                truth
            )
        expected = task.rows(split, n, seed=0)
        assert [r["prompt"] for r in rows] == [r["prompt"] for r in expected]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("a3=3;b4=7;c5=2;####2", 1.0),
        ("a3b4=7;c5=2;####2", 1.0),  # two items in one step
        (" a3=3;b4c5=2;####2\n", 1.0),
        ("a3=4;b4=7;c5=2;####2", 0.0),  # a slip that the next step cancels
        ("a3=3;b4=7;c5=2;####3", 0.0),  # the answer is not the last total
        ("a3b4c5=2;####2", 0.0),  # three items in one step
        ("b4=4;a3=7;c5=2;####2", 0.0),  # out of order
        ("a3=3;c5=8;####8", 0.0),  # an item left out
        ("a3=3;b4=7;c5=2;x####2", 0.0),  # text around the steps
        ("a3=3;b4=7;c5=2;", 0.0),  # no answer
        ("####2", 0.0),
    ],
)
def test_chain_sum_reward_checks_every_step(text, expected):
    from otbrl.rewards import BUILTIN_REWARDS

    reward = BUILTIN_REWARDS["chain_sum"]
    assert reward("otbrl/chain_sum", text, "2", {"items": "a3b4c5"}) == expected
    # a row without its items (from another dataset): the answer alone, as gsm8k scores it
    assert reward("otbrl/chain_sum", text, "2", {}) == float(text.strip().endswith("####2"))


def test_chain_sum_preset_and_model_fit_its_longest_answer(tmp_path):
    """The preset's response budget holds the longest answer, the built-in model built for the
    task has the positions prompt + budget need, and a budget past them (or below the longest
    answer) is refused before any model loads, naming the key."""
    import json

    from otbrl.config import ConfigError, load_config
    from otbrl.models import build_tiny_model
    from otbrl.run.plan import plan_run

    task = get_task("chain_sum")
    cfg = load_config(None, ["data.task=chain_sum"])
    assert cfg.data.max_response_length == task.max_response_chars + 1
    plan_run(cfg)
    path = build_tiny_model(tmp_path / "m", task="chain_sum", num_hidden_layers=1)
    positions = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    assert positions == task.model_size["max_position_embeddings"] >= 56 + 136
    with pytest.raises(ConfigError, match=r"max_response_length.*more than the model's 256"):
        plan_run(load_config(None, ["data.task=chain_sum", "data.max_response_length=250"]))
    with pytest.raises(ConfigError, match=r"set data.max_response_length=136"):
        plan_run(load_config(None, ["data.task=chain_sum", "data.max_response_length=100"]))
