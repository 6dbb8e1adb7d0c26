"""Data checked before the first step: file problems, unknown data sources and ground truths
are one line naming the file (or the values), exit 2, before any model loads."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from otbrl.config import ConfigError, load_config
from otbrl.data import get_task, read_parquet_rows, write_parquet_rows
from otbrl.rewards import score_responses
from otbrl.run.plan import plan_run
from run_utils import refused


def rows(n=32, **change):
    out = get_task("arithmetic").rows("train", n, seed=0)
    return [{**row, **change} for row in out]


def not_utf8_parquet(path):
    """A parquet file whose prompt text holds bytes that are not UTF-8 (pyarrow writes string
    buffers as they are; only reading them back as Python text fails)."""
    data = b"12+\xff\xfe="
    offsets = np.array([0, len(data)], dtype=np.int32)
    content = pa.Array.from_buffers(
        pa.string(), 1, [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(data)]
    )
    message = pa.StructArray.from_arrays([pa.array(["user"]), content], ["role", "content"])
    table = pa.table(
        {
            "prompt": pa.ListArray.from_arrays(pa.array([0, 1], pa.int32()), message),
            "data_source": ["otbrl/arithmetic"],
            "reward_model": [{"ground_truth": "3"}],
        }
    )
    pq.write_table(table, path)


def make_bad_files(root):
    """name -> (path, a fragment of the one-line error)."""
    text = root / "text.parquet"
    text.write_text("prompt,answer\n1+1=,2\n")
    not_utf8 = root / "latin1.parquet"
    not_utf8_parquet(not_utf8)
    empty = root / "empty.parquet"
    pq.write_table(pa.Table.from_pylist(rows(1)).slice(0, 0), empty)
    no_column = root / "no_reward_model.parquet"
    without = [{k: v for k, v in r.items() if k != "reward_model"} for r in rows(2)]
    pq.write_table(pa.Table.from_pylist(without), no_column)
    null_truth = root / "null_truth.parquet"
    pq.write_table(
        pa.Table.from_pylist([*rows(3), {**rows(1)[0], "reward_model": {"ground_truth": None}}]),
        null_truth,
    )
    binary = root / "binary.parquet"
    pq.write_table(
        pa.Table.from_pylist([{**rows(1)[0], "prompt": [{"role": "user", "content": b"\xff"}]}]),
        binary,
    )
    return {
        "binary text": (binary, "row 0: prompt message 'content' must be text, got bytes"),
        "not parquet": (text, "is not a readable parquet file"),
        "not UTF-8": (not_utf8, "not UTF-8"),
        "empty": (empty, "holds no rows"),
        "missing column": (no_column, "lacks the column(s) ['reward_model']"),
        "null ground truth": (null_truth, "row 3: 'ground_truth' must be a str, a number"),
    }


@pytest.mark.parametrize(
    "which",
    ["not parquet", "not UTF-8", "binary text", "empty", "missing column", "null ground truth"],
)
@pytest.mark.parametrize("key", ["data.train_files", "data.val_files"])
def test_file_problems_are_one_line_before_loading(
    which, key, tiny_run, tmp_path, capsys, no_model_loading
):
    path, fragment = make_bad_files(tmp_path)[which]
    argv = ["train", *tiny_run(tmp_path / "run"), f"{key}=[{path}]"]
    refused(argv, capsys, f"'{key}'", str(path), fragment)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_unknown_data_sources_are_listed_with_counts_before_loading(
    tiny_run, tmp_path, capsys, no_model_loading
):
    """The issue's probe: one rare data_source failed only when first sampled (step 11)."""
    data = rows(29) + rows(2, data_source="my/source") + rows(1, data_source="other/set")
    path = write_parquet_rows(data, tmp_path / "mixed.parquet")
    argv = ["train", *tiny_run(tmp_path / "run"), f"data.train_files=[{path}]"]
    err = refused(argv, capsys, "'reward.function'")
    assert "3 rows" in err and "'my/source' (2 rows)" in err and "'other/set' (1 row)" in err
    # with a reward function for every row, the same data is fine
    cfg = load_config(
        None,
        [*tiny_run(tmp_path / "run"), f"data.train_files=[{path}]", "reward.function=exact_match"],
    )
    assert len(plan_run(cfg).train_rows) == 32


def test_ground_truth_types_compare_the_way_a_user_means(tmp_path):
    base = rows(1)[0]
    table = pa.Table.from_pylist(
        [
            {**base, "reward_model": {"ground_truth": 102.0}},
            {**base, "reward_model": {"ground_truth": 0.5}},
        ]
    )
    pq.write_table(table, tmp_path / "floats.parquet")
    floats = read_parquet_rows(tmp_path / "floats.parquet")
    assert [r["reward_model"]["ground_truth"] for r in floats] == ["102", "0.5"]
    scores, _ = score_responses(["102", "0.5"], floats)
    assert scores == [1.0, 1.0]  # exact match against the number as written, not "102.0"
    scores, _ = score_responses(["#### 102", "#### 0.50"], floats, function="gsm8k")
    assert scores == [1.0, 1.0]
    pq.write_table(
        pa.Table.from_pylist([{**base, "reward_model": {"ground_truth": [7, 12]}}]),
        tmp_path / "lists.parquet",
    )
    (listed,) = read_parquet_rows(tmp_path / "lists.parquet")
    assert listed["reward_model"]["ground_truth"] == ["7", "12"]
    scores, _ = score_responses(["7", "12", "8"], [listed] * 3)
    assert scores == [1.0, 1.0, 0.0]  # any of the list
    # a parquet column has one type: each bad kind gets its own file
    for bad, fragment in ((True, "got bool"), ({"a": 1}, "got dict"), ([], "empty list")):
        pq.write_table(
            pa.Table.from_pylist([{**base, "reward_model": {"ground_truth": bad}}]),
            tmp_path / "bad.parquet",
        )
        with pytest.raises(ValueError, match=f"bad.parquet row 0: 'ground_truth'.*{fragment}"):
            read_parquet_rows(tmp_path / "bad.parquet")


def test_too_few_rows_for_a_batch_is_a_config_error(tiny_run, tmp_path):
    path = write_parquet_rows(rows(3), tmp_path / "small.parquet")
    cfg = load_config(None, [*tiny_run(tmp_path / "run"), f"data.train_files=[{path}]"])
    with pytest.raises(ConfigError, match=r"'data.train_batch_size' \(4\) is larger .*\(3 rows\)"):
        plan_run(cfg)


def test_val_files_are_used_with_the_built_in_task(tmp_path):
    """data.val_files without data.train_files: the files are the validation set (they were
    ignored, and the task's own validation rows used, before)."""
    path = write_parquet_rows(rows(5), tmp_path / "val.parquet")
    cfg = load_config(None, ["data.train_batch_size=4", f"data.val_files=[{path}]"])
    plan = plan_run(cfg)
    assert len(plan.val_rows) == 5 and len(plan.train_rows) > 1000
