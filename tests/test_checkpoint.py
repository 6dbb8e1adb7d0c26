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

from ckpt_utils import plant_pickle, reseal
from otbrl.engine.state import EngineState
from otbrl.store.checkpoint import (
    IntegrityError,
    capture_rng_state,
    checkpoint_step,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from otbrl.store.export import export_checkpoint
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


def make_engine(vocab_size, seed, **optim):
    """An engine on a tiny tied-embedding Llama: AdamW (weight decay) + a warmup schedule."""
    from otbrl.engine.optim import OptimConfig
    from otbrl.engine.spec import EngineSpec, MicroBatchConfig
    from otbrl.engine.trainable import TrainableEngine

    settings = dict(lr=1e-3, weight_decay=0.01, warmup_steps=4, **optim)
    spec = EngineSpec(micro=MicroBatchConfig(4))
    return TrainableEngine(tiny_llama(vocab_size, seed), OptimConfig(**settings), spec, seed=seed)


def states(**engines):
    """``save_checkpoint``'s / ``load_checkpoint``'s ``engines``: each trainable engine's
    checkpoint adapter (``EngineState``), by name."""
    return {name: EngineState(engine) for name, engine in engines.items()}


def train_step(engine, vocab_size):
    # The batch comes from the global RNG, so the step also checks that RNG streams resume.
    ids = torch.randint(3, vocab_size, (4, 12))
    loss = engine.model(input_ids=ids, labels=ids).loss
    engine.optimizer.zero_grad()
    loss.backward()
    engine.optimizer.step()
    engine.scheduler.step()
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
    engine = make_engine(vocab, seed=0)
    torch.manual_seed(1)
    for _ in range(3):
        train_step(engine, vocab)
    state = {"step": 3, "rng": capture_rng_state(), "data": {"epoch": 0, "cursor": 12}}
    path = save_checkpoint(
        tmp_path / "ckpt",
        3,
        engines=states(policy=engine),
        tokenizer=tokenizer,
        trainer_state=state,
        config={"actor": {"lr": 1e-3}, "trainer": {"logger": ("jsonl",), "out": tmp_path}},
    )
    assert path == tmp_path / "ckpt" / "step_3" and checkpoint_step(path) == 3
    assert yaml.safe_load((path / "config.yaml").read_text()) == {
        "actor": {"lr": 1e-3},
        "trainer": {"logger": ["jsonl"], "out": str(tmp_path)},
    }
    saved_optimizer = copy.deepcopy(engine.optimizer.state_dict())  # aliases live tensors
    saved_generator = engine.generator.get_state()
    # Reference: the uninterrupted run's next two steps and RNG draws.
    expected_losses = [train_step(engine, vocab) for _ in range(2)]
    expected_draws = (torch.rand(3), np.random.rand(3), random.random())
    expected_params = {k: v.clone() for k, v in engine.model.state_dict().items()}

    engine2 = make_engine(vocab, seed=99)  # different init and shuffling seed
    torch.manual_seed(12345)  # different RNG position
    restored = load_checkpoint(path, engines=states(policy=engine2))
    assert_nested_equal(restored, state)
    assert_nested_equal(engine2.optimizer.state_dict(), saved_optimizer)  # bit-identical
    assert engine2.scheduler.state_dict()["last_epoch"] == 3
    assert torch.equal(engine2.generator.get_state(), saved_generator)
    restore_rng_state(restored["rng"])
    losses = [train_step(engine2, vocab) for _ in range(2)]
    draws = (torch.rand(3), np.random.rand(3), random.random())
    for got, want in zip(losses, expected_losses):
        assert torch.equal(got, want)
    assert torch.equal(draws[0], expected_draws[0])
    assert np.array_equal(draws[1], expected_draws[1]) and draws[2] == expected_draws[2]
    for key, value in engine2.model.state_dict().items():
        assert torch.equal(value, expected_params[key]), key
    # Tied weights stay tied after the load.
    model2 = engine2.model
    assert model2.lm_head.weight.data_ptr() == model2.model.embed_tokens.weight.data_ptr()


def test_critic_and_frozen_engines(tmp_path, tokenizer):
    """A value model goes to critic/ with its own optimizer shards; a checkpoint without the
    critic cannot restore one."""
    from otbrl.engine.optim import OptimConfig
    from otbrl.engine.spec import EngineSpec
    from otbrl.engine.trainable import TrainableEngine
    from otbrl.models import load_value_model

    vocab = len(tokenizer)
    policy = make_engine(vocab, seed=0)
    policy.model.save_pretrained(tmp_path / "hf")
    critic = TrainableEngine(
        load_value_model(tmp_path / "hf"),
        OptimConfig(lr=1e-5, warmup_steps=0),
        EngineSpec(value=True),
        name="critic",
    )
    ids = torch.randint(3, vocab, (2, 6))
    critic.model(input_ids=ids).logits.sum().backward()
    critic.optimizer.step()
    path = save_checkpoint(tmp_path / "c", 1, engines=states(policy=policy, critic=critic))
    assert (path / "critic" / "model.safetensors").is_file()
    fresh = TrainableEngine(
        load_value_model(tmp_path / "hf"),
        OptimConfig(lr=1e-5, warmup_steps=0),
        EngineSpec(value=True),
        name="critic",
    )
    load_checkpoint(path, engines=states(policy=make_engine(vocab, seed=3), critic=fresh))
    for (name, a), b in zip(critic.model.state_dict().items(), fresh.model.state_dict().values()):
        assert torch.equal(a, b), name
    only_policy = save_checkpoint(tmp_path / "p", 1, engines=states(policy=policy))
    with pytest.raises(ValueError, match="critic"):
        load_checkpoint(only_policy, engines=states(policy=policy, critic=fresh))


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
    engines = states(policy=make_engine(len(tokenizer), seed=0))
    path = save_checkpoint(tmp_path, 1, engines=engines, trainer_state=state)
    restored = load_checkpoint(path, engines=engines)
    assert np.isnan(restored.pop("nan")) and np.isnan(state.pop("nan"))
    assert_nested_equal(restored, state)


def test_bad_trainer_state_fails_before_writing(tmp_path, tokenizer):
    engines = states(policy=make_engine(len(tokenizer), seed=0))
    with pytest.raises(TypeError, match=r"trainer_state\['trainer'\]\['data'\]\['sampler'\]"):
        save_checkpoint(tmp_path, 1, engines=engines, trainer_state={"data": {"sampler": object()}})
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="step"):
        save_checkpoint(tmp_path, -1, engines=engines)
    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(tmp_path, 1, engines=engines, keep_last=0)
    with pytest.raises(ValueError, match="policy"):
        save_checkpoint(tmp_path, 1, engines={"critic": engines["policy"]})


def test_failed_save_leaves_previous_checkpoint_and_no_partial(tmp_path, tokenizer, monkeypatch):
    engine = make_engine(len(tokenizer), seed=0)
    first = save_checkpoint(tmp_path, 1, engines=states(policy=engine), trainer_state={"a": 1})

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(tokenizer, "save_pretrained", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, engines=states(policy=engine), tokenizer=tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]
    assert latest_checkpoint(tmp_path) == first


def test_latest_ignores_temp_and_incomplete_dirs(tmp_path, tokenizer):
    assert latest_checkpoint(tmp_path / "missing") is None
    engines = states(policy=make_engine(len(tokenizer), seed=0))
    save_checkpoint(tmp_path, 2, engines=engines)
    save_checkpoint(tmp_path, 10, engines=engines)
    # What a SIGKILL mid-save leaves: a temp dir; and a step dir without its marker.
    (tmp_path / ".tmp-step_30-abc").mkdir()
    (tmp_path / ".tmp-step_30-abc" / "model.safetensors").write_bytes(b"torn")
    (tmp_path / "step_20").mkdir()
    (tmp_path / "step_9x").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_10"  # numeric, not lexicographic
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_2", "step_10"]
    with pytest.raises(ValueError, match="complete checkpoint"):
        load_checkpoint(tmp_path / "step_20", engines=engines)
    save_checkpoint(tmp_path, 11, engines=engines)  # the next save cleans up stale temp dirs
    assert not (tmp_path / ".tmp-step_30-abc").exists()


def test_keep_last_and_resave_same_step(tmp_path, tokenizer):
    engines = states(policy=make_engine(len(tokenizer), seed=0))
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, engines=engines, trainer_state={"v": step}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_3", "step_4"]
    save_checkpoint(tmp_path, 4, engines=engines, trainer_state={"v": 40}, keep_last=2)
    assert load_checkpoint(tmp_path / "step_4", engines=engines) == {"v": 40}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3", "step_4"]  # no temp dirs


def test_load_errors_name_the_problem(tmp_path, tokenizer):
    engines = states(policy=make_engine(len(tokenizer), seed=0))
    path = save_checkpoint(tmp_path, 1, engines=engines)
    other = states(policy=make_engine(len(tokenizer) + 5, seed=0))
    with pytest.raises(ValueError, match=r"embed_tokens.weight has shape \[\d+, 32\] there"):
        load_checkpoint(path, engines=other)
    qwen = tiny_causal_lm("qwen2", 0, vocab_size=len(tokenizer))  # another architecture
    from otbrl.engine.optim import OptimConfig
    from otbrl.engine.trainable import TrainableEngine

    with pytest.raises(ValueError, match="does not match the model"):
        load_checkpoint(path, engines=states(policy=TrainableEngine(qwen, OptimConfig())))


def test_no_file_of_a_checkpoint_is_unpickled(tmp_path, tokenizer):
    """Pickles dropped anywhere in a checkpoint (DCP's usual .metadata, a shard, the trainer
    state) are never executed: loading reads safetensors and JSON only. Unsealed, the extra
    files fail verification (naming them); resealed, as an attacker with write access would,
    the load succeeds and still runs nothing."""
    marker = tmp_path / "pwned"
    engines = states(policy=make_engine(len(tokenizer), seed=0))
    path = save_checkpoint(tmp_path / "ckpt", 1, engines=engines)
    for target in (path / "state" / "policy" / ".metadata", path / "state" / "policy" / "x.pt"):
        plant_pickle(target, marker)
    with pytest.raises(IntegrityError, match=r"'state/policy/\.metadata' is not in the manifest"):
        load_checkpoint(path, engines=engines)
    reseal(path)
    load_checkpoint(path, engines=engines)
    assert not marker.exists()
    shard = next((path / "state" / "policy").glob("*.safetensors"))
    plant_pickle(shard, marker)
    with pytest.raises(IntegrityError, match="shard-"):
        load_checkpoint(path, engines=engines)
    reseal(path)
    with pytest.raises(Exception):  # noqa: B017 — any parse error; what matters is below
        load_checkpoint(path, engines=engines)
    assert not marker.exists()
    with open(shard, "rb") as f:  # the payload is live: unpickling it does leave the marker
        pickle.load(f)
    assert marker.exists()


def test_export_loads_with_auto_classes(tmp_path, tokenizer):
    engine = make_engine(len(tokenizer), seed=0)
    path = save_checkpoint(
        tmp_path / "ckpt",
        5,
        engines=states(policy=engine),
        tokenizer=tokenizer,
        trainer_state={"rng": capture_rng_state()},
        config={"model": {"path": "tiny"}},
    )
    out = export_checkpoint(path, tmp_path / "export")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not names & {"state", "config.yaml", "checkpoint.json", "critic"}

    loaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(3, len(tokenizer), (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, engine.model(input_ids=ids).logits)
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
    with pytest.raises(ValueError, match="neither a checkpoint"):
        export_checkpoint(tmp_path / "broken", tmp_path / "export2")
    assert json.loads((path / "checkpoint.json").read_text())["step"] == 5


KILLED_SAVE = """
import os, signal, sys
sys.path.insert(0, sys.argv[2])
import otbrl.store.checkpoint as ckpt
from otbrl.engine.optim import OptimConfig
from otbrl.engine.state import EngineState
from otbrl.engine.trainable import TrainableEngine
from tiny_models import tiny_causal_lm
engines = {"policy": EngineState(TrainableEngine(tiny_causal_lm(), OptimConfig()))}
ckpt.save_checkpoint(sys.argv[1], 1, engines=engines, trainer_state={"step": 1})
real_replace = os.replace
def replace_then_die(src, dst):
    if os.path.basename(str(dst)) == "step_2":  # killed right before the publishing rename
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst)
ckpt.os.replace = replace_then_die
ckpt.save_checkpoint(sys.argv[1], 2, engines=engines, trainer_state={"step": 2})
"""


def test_sigkill_during_save_leaves_the_previous_checkpoint(tmp_path):
    from otbrl.engine.optim import OptimConfig
    from otbrl.engine.trainable import TrainableEngine

    tests = os.path.dirname(__file__)
    cmd = [sys.executable, "-c", KILLED_SAVE, str(tmp_path), tests]
    assert subprocess.run(cmd, capture_output=True, timeout=120).returncode == -9
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-step_2")]
    assert len(leftovers) == 1  # the fully written but unpublished step 2
    assert latest_checkpoint(tmp_path) == tmp_path / "step_1"
    saved = tiny_causal_lm()  # what the child saved
    engine = TrainableEngine(tiny_causal_lm(seed=4), OptimConfig())
    engines = states(policy=engine)
    assert load_checkpoint(tmp_path / "step_1", engines=engines) == {"step": 1}
    for (name, a), b in zip(saved.state_dict().items(), engine.model.state_dict().values()):
        assert torch.equal(a, b), name
    save_checkpoint(tmp_path, 2, engines=engines, trainer_state={"step": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_2"]


@pytest.mark.parametrize("lora_rank", [0, 16], ids=["full", "lora"])
def test_the_announced_size_is_what_a_checkpoint_takes(tmp_path, tokenizer, lora_rank):
    """Issue 53: a LoRA run announced ~6.8 MB checkpoints that took 1.0 MB (the estimate
    counted the frozen base and its AdamW moments; the checkpoint holds the adapter and the
    adapter's moments). The estimate against every file a real save writes: within 10 % (the
    rest is configs, the tokenizer and the trainer state, a few KB here)."""
    pytest.importorskip("peft")
    from otbrl.engine.optim import OptimConfig
    from otbrl.engine.spec import EngineSpec, MicroBatchConfig
    from otbrl.engine.trainable import TrainableEngine
    from otbrl.models.config import LoraConfig
    from otbrl.models.lora import add_lora
    from otbrl.run.announce import engine_bytes

    vocab = len(tokenizer)
    model = tiny_causal_lm(
        "llama", 0, vocab_size=vocab, hidden_size=128, intermediate_size=256,
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    if lora_rank:
        model = add_lora(model, LoraConfig(rank=lora_rank, alpha=32.0))
    spec = EngineSpec(micro=MicroBatchConfig(4))
    engine = TrainableEngine(model, OptimConfig(lr=1e-3, warmup_steps=0), spec, seed=0)
    train_step(engine, vocab)  # AdamW's moments exist from the first step on
    path = save_checkpoint(tmp_path, 1, engines=states(policy=engine), tokenizer=tokenizer)
    written = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    estimate = engine_bytes(engine)
    assert abs(estimate - written) <= 0.10 * written, (estimate, written)
