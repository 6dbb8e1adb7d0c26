import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from otbrl.data import (
    PromptDataset,
    encode_prompts,
    get_task,
    read_parquet_rows,
    write_parquet_rows,
)
from otbrl.models import build_tiny_model, load_model_and_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny"), hidden_size=16, num_hidden_layers=1)
    return load_model_and_tokenizer(path)[1]


def _rows(contents):
    return [
        {
            "prompt": [{"role": "user", "content": c}],
            "data_source": "otbrl/arithmetic",
            "reward_model": {"ground_truth": "0"},
            "extra_info": {"index": i},
        }
        for i, c in enumerate(contents)
    ]


def test_encode_prompts_left_pads_the_chat_template(tokenizer):
    rows = _rows(["1+2=", "12+345=", "9="])
    enc = encode_prompts(rows, tokenizer, max_prompt_length=32)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    assert ids.dtype == mask.dtype == torch.long and ids.shape == mask.shape
    for i, row in enumerate(rows):
        # Reference: the chat template tokenized one row at a time, no padding.
        ref = list(
            tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)[
                "input_ids"
            ]
        )
        k = len(ref)
        assert ids[i, ids.shape[1] - k :].tolist() == ref
        assert mask[i].tolist() == [0] * (ids.shape[1] - k) + [1] * k
        assert (ids[i, : ids.shape[1] - k] == tokenizer.pad_token_id).all()
    assert ids.shape[1] == len("12+345=") + 3  # bos, <user>, <assistant>


def test_encode_prompts_rejects_long_prompts_naming_the_row(tokenizer):
    rows = _rows(["1+2=", "1234567890+1234567890="])
    with pytest.raises(ValueError, match="row 1"):
        encode_prompts(rows, tokenizer, max_prompt_length=12)
    with pytest.raises(ValueError, match="rows"):
        encode_prompts([], tokenizer, max_prompt_length=12)


def test_parquet_round_trip(tmp_path):
    rows = get_task("arithmetic").rows("val", 40, seed=1)
    path = write_parquet_rows(rows, tmp_path / "sub" / "val.parquet")
    assert read_parquet_rows(path) == rows
    assert read_parquet_rows([path, path]) == rows + rows
    assert not list(tmp_path.glob("sub/.*"))  # no temp file left behind


def test_parquet_numbers_and_missing_extra_info(tmp_path):
    table = pa.Table.from_pylist(
        [
            {
                "prompt": [{"role": "user", "content": "q"}],
                "data_source": "openai/gsm8k",
                "reward_model": {"ground_truth": 72},
            }
        ]
    )
    pq.write_table(table, tmp_path / "x.parquet")
    (row,) = read_parquet_rows(tmp_path / "x.parquet")
    assert row["reward_model"]["ground_truth"] == "72" and row["extra_info"] == {}


def test_parquet_schema_errors_name_file_and_row(tmp_path):
    good = _rows(["1+1="])[0]
    bad = {k: v for k, v in good.items() if k != "reward_model"}
    pq.write_table(
        pa.Table.from_pylist([good, {**bad, "reward_model": None}]), tmp_path / "b.parquet"
    )
    with pytest.raises(ValueError, match=r"b\.parquet row 1.*reward_model"):
        read_parquet_rows(tmp_path / "b.parquet")
    with pytest.raises(ValueError, match="does not exist"):
        read_parquet_rows(tmp_path / "missing.parquet")
    with pytest.raises(ValueError, match="files"):
        read_parquet_rows([])
    with pytest.raises(ValueError, match="prompt"):
        write_parquet_rows([{**good, "prompt": "not a chat"}], tmp_path / "c.parquet")


def test_dataset_epochs_are_permutations_and_reshuffle(tokenizer):
    rows = _rows([f"{i}+1=" for i in range(10)])
    ds = PromptDataset(rows, tokenizer, max_prompt_length=16, batch_size=3, seed=4)
    assert len(ds) == 3
    epochs = []
    for _ in range(3):
        seen = [r["extra_info"]["index"] for _ in range(3) for r in ds.next_batch()]
        assert len(set(seen)) == 9  # a batch never repeats a row within an epoch
        epochs.append(seen)
    assert epochs[0] != epochs[1]
    again = PromptDataset(rows, tokenizer, max_prompt_length=16, batch_size=3, seed=4)
    assert [r["extra_info"]["index"] for _ in range(3) for r in again.next_batch()] == epochs[0]
    ordered = PromptDataset(rows, None, max_prompt_length=16, batch_size=5, shuffle=False)
    assert [r["extra_info"]["index"] for r in ordered.next_batch()] == [0, 1, 2, 3, 4]


def test_dataset_resumes_exactly(tokenizer):
    rows = _rows([f"{i}=" for i in range(7)])
    ds = PromptDataset(rows, tokenizer, max_prompt_length=16, batch_size=2, seed=0)
    for _ in range(5):
        ds.next_batch()
    state = ds.state_dict()
    expected = [ds.next_batch() for _ in range(6)]
    resumed = PromptDataset(rows, tokenizer, max_prompt_length=16, batch_size=2, seed=0)
    resumed.load_state_dict(dict(state))
    assert [resumed.next_batch() for _ in range(6)] == expected
    with pytest.raises(ValueError, match="state"):
        resumed.load_state_dict({"epoch": 0, "position": 99})


def test_dataset_bad_arguments(tokenizer):
    rows = _rows(["1=", "2=", "1234567890123456="])
    with pytest.raises(ValueError, match="batch_size"):
        PromptDataset(rows, tokenizer, max_prompt_length=32, batch_size=4)
    with pytest.raises(ValueError, match="batch_size"):
        PromptDataset(rows, tokenizer, max_prompt_length=32, batch_size=0)
    with pytest.raises(ValueError, match="row 2"):
        PromptDataset(rows, tokenizer, max_prompt_length=8, batch_size=1)
    with pytest.raises(ValueError, match=r"rows\[0\]"):
        PromptDataset([{"prompt": []}], None, max_prompt_length=8, batch_size=1)
