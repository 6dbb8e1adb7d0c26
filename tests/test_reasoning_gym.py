"""reasoning-gym datasets by name: every dataset the installed version lists loads as a task and
its rows score their own reference answers 1.0 through ``otbrl.rewards.compute_score``, wrong
answers as reasoning-gym's own ``score_answer`` does on the same entries; composites by weight;
options and sizes from the data keys; a parquet export that scores the same; config errors that
name the key."""

import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest

from otbrl.config import ConfigError, load_config
from otbrl.data import read_parquet_rows, write_parquet_rows
from otbrl.data.reasoning_gym import ReasoningGymTask, decode_entry, encode_entry
from otbrl.rewards import compute_score
from otbrl.run.plan import load_rows

warnings.filterwarnings("ignore", category=SyntaxWarning)  # cellpylib, on import
reasoning_gym = pytest.importorskip("reasoning_gym")
from reasoning_gym.factory import DATASETS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# datasets without a reference answer (the entry's answer is None: any answer that passes the
# dataset's own verification scores), listed in docs/environments.md
NO_REFERENCE = {"boxnet", "graph_color", "propositional_logic", "rubiks_cube", "rush_hour"}
# reasoning-gym's score_answer raises on an answer it cannot parse: otbrl scores it 0.0
RAISES_ON_WORDS = {"prime_factorization"}
# entries drawn from a stream shared across a dataset's entries: two instances with one seed
# give other entries (so a row keeps its entry instead of its seed and index)
SHARED_STREAM = {"codeio"}
WRONG = "definitely not the answer"


def test_every_dataset_scores_its_own_answers():
    names = sorted(set(DATASETS) - {"composite"})
    assert len(names) >= 100  # reasoning-gym 0.1.25 lists 105 besides the composite
    checked = 0
    for name in names:
        task = ReasoningGymTask(name, val_size=2)
        rows = task.rows("val")
        # the same entries straight from reasoning-gym: the reference scorer
        reference = reasoning_gym.create_dataset(name, size=2, seed=task_seed("val"))
        for i, row in enumerate(rows):
            item = reference[i]
            assert decode_entry(encode_entry(item)) == item, name  # typed JSON round trip
            ours = entry(row)
            assert row["prompt"][-1]["content"] == ours["question"]
            if name not in SHARED_STREAM:
                assert ours == item, name
            assert row["data_source"] == f"reasoning_gym/{name}"
            truth = row["reward_model"]["ground_truth"]
            extra = row["extra_info"]
            if name not in NO_REFERENCE:
                assert compute_score(row["data_source"], truth, truth, extra) == 1.0, name
                tagged = f"Thinking...\n<answer>{truth}</answer>"
                assert compute_score(row["data_source"], tagged, truth, extra) == 1.0, name
                checked += 1
            else:
                assert ours["answer"] is None and truth == ""
            score = compute_score(row["data_source"], WRONG, truth, extra)
            if name in RAISES_ON_WORDS:
                with pytest.raises(ValueError):
                    reference.score_answer(WRONG, ours)
                assert score == 0.0
            else:
                assert score == float(reference.score_answer(WRONG, ours)), name
    assert checked >= 2 * (len(names) - len(NO_REFERENCE))


def entry(row) -> dict:
    return decode_entry(row["extra_info"]["reasoning_gym_entry"])


def task_seed(split: str, seed: int = 0) -> int:
    from otbrl.data.reasoning_gym import VAL_SEED_OFFSET

    return seed + (VAL_SEED_OFFSET if split == "val" else 0)


def test_composite_options_sizes_and_parquet(tmp_path):
    task = ReasoningGymTask(
        "leg_counting=3,basic_arithmetic=1",
        {"leg_counting": {"min_animals": 2, "max_animals": 2}},
        train_size=400,
        val_size=8,
    )
    rows = task.rows("train")
    sources = Counter(r["data_source"] for r in rows)
    assert set(sources) == {"reasoning_gym/leg_counting", "reasoning_gym/basic_arithmetic"}
    assert 0.65 < sources["reasoning_gym/leg_counting"] / 400 < 0.85  # weight 3 of 4
    legs = [entry(r) for r in rows if r["data_source"] == "reasoning_gym/leg_counting"]
    assert all(len(e["metadata"]["animals"]) == 2 for e in legs)  # the option reached it
    path = write_parquet_rows(rows[:20], tmp_path / "rg.parquet")
    for row in read_parquet_rows(path):
        truth = row["reward_model"]["ground_truth"]
        assert compute_score(row["data_source"], truth, truth, row["extra_info"]) == 1.0
    # the train and val generators are drawn apart
    val = {r["prompt"][-1]["content"] for r in task.rows("val")}
    assert len(val - {r["prompt"][-1]["content"] for r in rows}) >= 6
    with pytest.raises(ValueError, match="no dataset 'no_such_set'"):
        ReasoningGymTask("no_such_set")
    with pytest.raises(ValueError, match="weight"):
        ReasoningGymTask("leg_counting=0")
    with pytest.raises(ValueError, match="task_options"):
        ReasoningGymTask("leg_counting=1,basic_arithmetic=1", {"other": {}})


def test_the_config_names_the_key(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    base = [f"model.path={model}", "data.task=reasoning_gym:leg_counting", "data.val_size=4",
            "data.train_size=16"]  # fmt: skip
    train, val = load_rows(
        load_config(
            None, [*base, "data.task_options.min_animals=2", "data.task_options.max_animals=3"]
        )
    )
    assert len(train) == 16 and len(val) == 4
    assert all(len(entry(r)["metadata"]["animals"]) <= 3 for r in train)
    cases = [
        ([*base, "data.task_options.no_such_field=1"], "data.task_options"),
        ([f"model.path={model}", "data.task=reasoning_gym:nope"], "data.task"),
    ]
    for overrides, key in cases:
        with pytest.raises(ConfigError) as err:
            load_rows(load_config(None, overrides))
        assert err.value.key == key
    with pytest.raises(ConfigError, match="model of yours"):
        load_config(None, ["data.task=reasoning_gym:leg_counting"])
    with pytest.raises(ConfigError, match=r"data\.task_options"):
        load_config(None, ["data.task=arithmetic", "data.task_options.x=1"])


def test_make_parquet_exports_a_dataset(tmp_path):
    out = tmp_path / "legs"
    subprocess.run(
        [sys.executable, str(ROOT / "examples/make_parquet.py"), "--out", str(out), "--task",
         "reasoning_gym:leg_counting", "--task-options", '{"min_animals": 2, "max_animals": 2}',
         "--n-train", "8", "--n-val", "4"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    rows = read_parquet_rows(out / "train.parquet")
    assert len(rows) == 8 and len(read_parquet_rows(out / "val.parquet")) == 4
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        assert row["extra_info"]["answer"] == f"<answer>{truth}</answer>"
        assert compute_score(row["data_source"], row["extra_info"]["answer"], truth,
                             row["extra_info"]) == 1.0  # fmt: skip
