"""Checkpoints: exact restore, atomicity, keep-last-N, export to a plain HF dir, no pickles."""

import copy
import json
import os
import pickle
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
)

from otbrl.checkpoint import (
    capture_rng_state,
    checkpoint_step,
    export_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from tiny_models import tiny_causal_lm

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    # Byte-level BPE: survives AutoTokenizer's class choice (see NOTES.md's tokenizer pitfall).
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["12 + 34 = 46\n", "what is 5 + 7?", "answer: 12"] * 20, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def tiny_llama(vocab_size, seed):
    return tiny_causal_lm(
        "llama",
        seed,
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def make_training(vocab_size, seed):
    model = tiny_llama(vocab_size, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler, vocab_size):
    # The batch comes from the global RNG, so the step also checks that RNG streams resume.
    ids = torch.randint(3, vocab_size, (4, 12))
    loss = model(input_ids=ids, labels=ids).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss.detach()


def assert_nested_equal(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_nested_equal(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_nested_equal(x, y)
    else:
        assert a == b


def test_round_trip_is_exact_and_training_continues_identically(tmp_path, tokenizer):
    vocab = len(tokenizer)
    model, optimizer, scheduler = make_training(vocab, seed=0)
    torch.manual_seed(1)
    for _ in range(3):
        train_step(model, optimizer, scheduler, vocab)
    state = {"step": 3, "rng": capture_rng_state(), "data": {"epoch": 0, "cursor": 12}}
    path = save_checkpoint(
        tmp_path / "ckpt",
        3,
        model=model,
        tokenizer=tokenizer,
        optimizer=optimizer,
        scheduler=scheduler,
        trainer_state=state,
        config={"actor": {"lr": 1e-3}, "trainer": {"logger": ("jsonl",), "out": tmp_path}},
    )
    assert path == tmp_path / "ckpt" / "step_3" and checkpoint_step(path) == 3
    assert yaml.safe_load((path / "config.yaml").read_text()) == {
        "actor": {"lr": 1e-3},
        "trainer": {"logger": ["jsonl"], "out": str(tmp_path)},
    }
    saved_optimizer = copy.deepcopy(optimizer.state_dict())  # state_dict() aliases live tensors
    # Reference: the uninterrupted run's next two steps and RNG draws.
    expected_losses = [train_step(model, optimizer, scheduler, vocab) for _ in range(2)]
    expected_draws = (torch.rand(3), np.random.rand(3), random.random())
    expected_params = {k: v.clone() for k, v in model.state_dict().items()}

    model2, optimizer2, scheduler2 = make_training(vocab, seed=99)  # different init
    torch.manual_seed(12345)  # different RNG position
    restored = load_checkpoint(path, model=model2, optimizer=optimizer2, scheduler=scheduler2)
    assert_nested_equal(restored, state)
    assert_nested_equal(optimizer2.state_dict(), saved_optimizer)  # bit-identical
    assert scheduler2.state_dict()["last_epoch"] == 3
    restore_rng_state(restored["rng"])
    losses = [train_step(model2, optimizer2, scheduler2, vocab) for _ in range(2)]
    draws = (torch.rand(3), np.random.rand(3), random.random())
    for got, want in zip(losses, expected_losses):
        assert torch.equal(got, want)
    assert torch.equal(draws[0], expected_draws[0])
    assert np.array_equal(draws[1], expected_draws[1]) and draws[2] == expected_draws[2]
    for key, value in model2.state_dict().items():
        assert torch.equal(value, expected_params[key]), key
    # Tied weights stay tied after the load.
    assert model2.lm_head.weight.data_ptr() == model2.model.embed_tokens.weight.data_ptr()


def test_trainer_state_keeps_types(tmp_path, tokenizer):
    state = {
        "tuple": (3, (1.5, None), "x"),
        "int_keys": {0: "a", 7: [1, 2]},
        "dunder": {"__tensor__": "not a reference"},
        "uint32": np.arange(5, dtype=np.uint32) * np.uint32(4_000_000_000 // 5),
        "f64": torch.linspace(0, 1, 7, dtype=torch.float64).reshape(7, 1),
        "bool": torch.tensor([True, False]),
        "view": torch.arange(10)[2:5],
        "same_twice": [torch.ones(2), torch.ones(2)],
        "nan": float("nan"),
    }
    model = tiny_llama(len(tokenizer), seed=0)
    path = save_checkpoint(tmp_path, 1, model=model, trainer_state=state)
    restored = load_checkpoint(path, model=model)
    assert np.isnan(restored.pop("nan")) and np.isnan(state.pop("nan"))
    assert_nested_equal(restored, state)


def test_bad_trainer_state_fails_before_writing(tmp_path, tokenizer):
    model = tiny_llama(len(tokenizer), seed=0)
    with pytest.raises(TypeError, match=r"trainer_state\['data'\]\['sampler'\].*object"):
        save_checkpoint(tmp_path, 1, model=model, trainer_state={"data": {"sampler": object()}})
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="step"):
        save_checkpoint(tmp_path, -1, model=model)
    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(tmp_path, 1, model=model, keep_last=0)


def test_failed_save_leaves_previous_checkpoint_and_no_partial(tmp_path, tokenizer, monkeypatch):
    model, optimizer, scheduler = make_training(len(tokenizer), seed=0)
    first = save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer, trainer_state={"a": 1})

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(scheduler, "state_dict", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, model=model, optimizer=optimizer, scheduler=scheduler)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]
    assert latest_checkpoint(tmp_path) == first


def test_latest_ignores_temp_and_incomplete_dirs(tmp_path, tokenizer):
    assert latest_checkpoint(tmp_path / "missing") is None
    model = tiny_llama(len(tokenizer), seed=0)
    save_checkpoint(tmp_path, 2, model=model)
    save_checkpoint(tmp_path, 10, model=model)
    # What a SIGKILL mid-save leaves: a temp dir; and a step dir without its marker.
    (tmp_path / ".tmp-step_30-abc").mkdir()
    (tmp_path / ".tmp-step_30-abc" / "model.safetensors").write_bytes(b"torn")
    (tmp_path / "step_20").mkdir()
    (tmp_path / "step_9x").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_10"  # numeric, not lexicographic
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_2", "step_10"]
    with pytest.raises(ValueError, match="complete checkpoint"):
        load_checkpoint(tmp_path / "step_20", model=model)
    save_checkpoint(tmp_path, 11, model=model)  # the next save cleans up stale temp dirs
    assert not (tmp_path / ".tmp-step_30-abc").exists()


def test_keep_last_and_resave_same_step(tmp_path, tokenizer):
    model = tiny_llama(len(tokenizer), seed=0)
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, model=model, trainer_state={"v": step}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_3", "step_4"]
    save_checkpoint(tmp_path, 4, model=model, trainer_state={"v": 40}, keep_last=2)
    assert load_checkpoint(tmp_path / "step_4", model=model) == {"v": 40}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3", "step_4"]  # no temp dirs


def test_load_errors_name_the_problem(tmp_path, tokenizer):
    model = tiny_llama(len(tokenizer), seed=0)
    path = save_checkpoint(tmp_path, 1, model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="optimizer"):
        load_checkpoint(path, model=model, optimizer=optimizer)
    other = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="does not match the model"):
        load_checkpoint(path, model=other)


class Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_arbitrary_pickles_are_refused(tmp_path, tokenizer):
    model, optimizer, _ = make_training(len(tokenizer), seed=0)
    path = save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer)
    with open(path / "optimizer.pt", "wb") as f:
        pickle.dump({"state": Payload()}, f, protocol=2)
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(path, model=model, optimizer=optimizer)


def test_export_loads_with_auto_classes(tmp_path, tokenizer):
    model, optimizer, scheduler = make_training(len(tokenizer), seed=0)
    path = save_checkpoint(
        tmp_path / "ckpt",
        5,
        model=model,
        tokenizer=tokenizer,
        optimizer=optimizer,
        scheduler=scheduler,
        trainer_state={"rng": capture_rng_state()},
        config={"model": {"path": "tiny"}},
    )
    out = export_checkpoint(path, tmp_path / "export")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not names & {"optimizer.pt", "scheduler.pt", "trainer_state.json", "checkpoint.json"}

    loaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(3, len(tokenizer), (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    tok = AutoTokenizer.from_pretrained(out)
    text = "what is  12 + 34?\n answer: 46"
    assert tok.encode(text, add_special_tokens=False) == tokenizer.encode(
        text, add_special_tokens=False
    )
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    messages = [{"role": "user", "content": "5 + 7 = ?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "user: 5 + 7 = ?\nassistant: "
    assert tok.eos_token == "</s>" and tok.pad_token == "<pad>"

    with pytest.raises(ValueError, match="out_dir"):
        export_checkpoint(path, out)  # not empty
    (tmp_path / "broken").mkdir()
    with pytest.raises(ValueError, match="complete checkpoint"):
        export_checkpoint(tmp_path / "broken", tmp_path / "export2")
    assert json.loads((path / "checkpoint.json").read_text())["step"] == 5


KILLED_SAVE = """
import os, signal, sys
import torch
import otbrl.checkpoint as ckpt
torch.manual_seed(0)
model = torch.nn.Linear(4, 3)
ckpt.save_checkpoint(sys.argv[1], 1, model=model, trainer_state={"step": 1})
real_replace = os.replace
def replace_then_die(src, dst):
    if os.path.basename(str(dst)) == "step_2":  # killed right before the publishing rename
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst)
ckpt.os.replace = replace_then_die
ckpt.save_checkpoint(sys.argv[1], 2, model=model, trainer_state={"step": 2})
"""


def test_sigkill_during_save_leaves_the_previous_checkpoint(tmp_path):
    cmd = [sys.executable, "-c", KILLED_SAVE, str(tmp_path)]
    assert subprocess.run(cmd, capture_output=True, timeout=120).returncode == -9
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-step_2")]
    assert len(leftovers) == 1  # the fully written but unpublished step 2
    assert latest_checkpoint(tmp_path) == tmp_path / "step_1"
    torch.manual_seed(0)
    saved = torch.nn.Linear(4, 3)  # what the child saved
    model = torch.nn.Linear(4, 3)
    assert load_checkpoint(tmp_path / "step_1", model=model) == {"step": 1}
    assert torch.equal(model.weight, saved.weight) and torch.equal(model.bias, saved.bias)
    with pytest.raises(ValueError, match="no Hugging Face model"):
        export_checkpoint(tmp_path / "step_1", tmp_path / "out")  # a plain nn.Module
    save_checkpoint(tmp_path, 2, model=model, trainer_state={"step": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_2"]
