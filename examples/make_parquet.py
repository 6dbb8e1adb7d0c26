"""Write a train/val pair of parquet files in the RL schema that ``otbrl train`` reads.

    python examples/make_parquet.py --out data/arith                 # the built-in task
    python examples/make_parquet.py --out data/chain --task chain_sum  # any built-in task
    python examples/make_parquet.py --out data/toy_gsm8k --gsm8k-toy  # GSM8K-shaped word problems
    python examples/make_parquet.py --out data/legs --task reasoning_gym:leg_counting \
        --task-options '{"min_animals": 2}'                         # a reasoning-gym dataset

Then: ``otbrl train data.train_files=data/arith/train.parquet \
data.val_files=data/arith/val.parquet``.
Each row: ``prompt`` (chat messages), ``data_source`` (selects the reward: ``otbrl/arithmetic``
→ exact match, ``openai/gsm8k`` → ``#### answer`` extraction), ``reward_model.ground_truth``.
A built-in task's rows also carry its demonstration as ``extra_info.answer`` (where verl's SFT
datasets look for the response), so another framework can warm-start on them. ``chain_sum``'s
reward is ``otbrl.rewards.builtin.chain_sum`` (verl's ``compute_score`` signature: point verl's
``custom_reward_function`` at it); its answers end in ``####N``, so verl's GSM8K scorer
(``--data-source openai/gsm8k``) grades them too, on the answer alone — a weaker reward that
pays for chains whose slips cancel. A reasoning-gym dataset's rows (``reasoning_gym:NAME``, or
a weighted composite ``reasoning_gym:A=2,B=1``) carry their entry in ``extra_info``: their
reward is ``otbrl.rewards.compute_score`` (data_source ``reasoning_gym/NAME``), the dataset's own
``score_answer``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from otbrl.data import get_task, write_parquet_rows
from otbrl.data.reasoning_gym import TASK_PREFIX, ReasoningGymTask

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Femi"]
THINGS = ["apples", "pencils", "stickers", "marbles", "books"]


def gsm8k_toy_rows(n: int, seed: int, split: str) -> list[dict]:
    """``n`` two-step word problems shaped like GSM8K rows (question, worked answer, number)."""
    rng = random.Random(f"{seed}-{split}")
    rows = []
    for index in range(n):
        name, thing = rng.choice(NAMES), rng.choice(THINGS)
        boxes, per_box, given = rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 9)
        total = boxes * per_box
        question = (
            f"{name} has {boxes} boxes with {per_box} {thing} in each box and gives away "
            f"{given} {thing}. How many {thing} does {name} have left?"
        )
        left = total - given
        solution = f"{boxes} * {per_box} = {total}. {total} - {given} = {left}.\n#### {left}"
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "data_source": "openai/gsm8k",
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(left)},
                "extra_info": {"split": split, "index": index, "answer": solution},
            }
        )
    return rows


def task_rows(
    name: str, n: int, seed: int, split: str, data_source: str | None, options=None
) -> list[dict]:
    """``n`` rows of built-in task ``name`` (or a reasoning-gym dataset with its ``options``)
    with their demonstrations in ``extra_info.answer`` (text demonstrations only: a
    multi-turn task's turns stay out); ``data_source`` replaces the task's own when given."""
    if name.startswith(TASK_PREFIX):
        task = ReasoningGymTask(name[len(TASK_PREFIX) :], options, train_size=n, val_size=n)
    else:
        task = get_task(name)
    rows = task.rows(split, n, seed=seed)
    for row in rows:
        answer = task.demonstration(row)
        if isinstance(answer, str):
            row["extra_info"]["answer"] = answer
        if data_source is not None:
            row["data_source"] = data_source
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for train/val.parquet")
    parser.add_argument("--gsm8k-toy", action="store_true", help="GSM8K-shaped toy set instead")
    parser.add_argument(
        "--task", default="arithmetic", help="a built-in task, or reasoning_gym:NAME[=W,...]"
    )
    parser.add_argument(
        "--task-options", default="{}", help="a reasoning-gym dataset's options (JSON)"
    )
    parser.add_argument(
        "--data-source", default=None, help="data_source of every row (default: the task's)"
    )
    parser.add_argument("--n-train", type=int, default=2000)
    parser.add_argument("--n-val", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.gsm8k_toy:
        train = gsm8k_toy_rows(args.n_train, args.seed, "train")
        val = gsm8k_toy_rows(args.n_val, args.seed, "val")
    else:
        options = json.loads(args.task_options)
        train = task_rows(args.task, args.n_train, args.seed, "train", args.data_source, options)
        val = task_rows(args.task, args.n_val, args.seed, "val", args.data_source, options)
    for split, rows in (("train", train), ("val", val)):
        path = write_parquet_rows(rows, args.out / f"{split}.parquet")
        print(f"{path}: {len(rows)} rows, e.g. {rows[0]['prompt'][-1]['content'][:120]!r}")


if __name__ == "__main__":
    main()
