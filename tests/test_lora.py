"""LoRA through peft (otbrl.models.lora, model.lora.*): only the adapters train, the reference is
the base model with no second copy, merged weights and PEFT's adapter format reproduce the
trained model, and bad adapters or targets are one line before any training."""

from __future__ import annotations

import json

import pytest
import torch

from otbrl import cli
from otbrl.engine.layout import Layout, forward_outputs
from otbrl.engine.spec import EngineSpec, MicroBatchConfig
from otbrl.engine.trainable import TrainableEngine
from otbrl.models import build_tiny_model, load_model_and_tokenizer
from otbrl.models.config import LoraConfig
from otbrl.models.lora import (
    adapter_config,
    adapter_tensors,
    add_lora,
    linear_module_names,
    save_adapter,
    unload_lora,
)
from otbrl.models.weights import full_tensors
from test_engine import make_batch, rl_batch, tiny_model
from test_precision import actor

pytest.importorskip("peft")

LP = frozenset({"log_probs"})


def lora_model(seed=0, rank=4, **kw):
    return add_lora(tiny_model(seed=seed), LoraConfig(rank=rank, alpha=8.0, **kw))


def log_probs(model, batch):
    with torch.no_grad():
        return forward_outputs(model.eval(), batch, Layout(), outputs=LP)["log_probs"]


def trained_lora_engine(**spec_kw):
    spec = EngineSpec(micro=MicroBatchConfig(3), **spec_kw)
    engine = TrainableEngine(lora_model(), actor(lr=5e-2), spec)
    for seed in range(2):
        engine.update(rl_batch(engine, seed=seed), _loss())
    return engine


def _loss():
    from otbrl.algos.loss_terms import build_loss

    return build_loss()


def test_only_the_adapters_train_and_the_reference_is_the_base_model():
    base = tiny_model()
    engine = trained_lora_engine()
    model = engine.model
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert {id(p) for g in engine.optimizer.param_groups for p in g["params"]} == {
        id(p) for n, p in model.named_parameters() if n in trained
    }
    # the frozen weights are the base model's, bit for bit; the adapters moved
    plain = dict(base.named_parameters())
    for name, p in model.named_parameters():
        if name in trained:
            continue
        assert torch.equal(p, plain[name.replace(".base_layer", "")]), name
    assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if ".lora_B." in n)
    batch = make_batch()
    reference = engine.without_adapters(micro=MicroBatchConfig(4))
    ref = reference.compute(batch, LP)["log_probs"]
    torch.testing.assert_close(ref, log_probs(base, batch), atol=1e-6, rtol=0)
    policy = engine.compute(batch, LP)["log_probs"]
    assert (policy - ref).abs().max() > 1e-3  # the adapters are on again outside the view
    # no second copy: the reference view holds the policy's very modules
    assert reference.model is engine.model and not hasattr(reference, "optimizer")


def test_merged_tensors_reproduce_the_trained_model():
    engine = trained_lora_engine()
    batch = make_batch()
    want = engine.compute(batch, LP)["log_probs"]
    plain = tiny_model(seed=1)  # other weights: everything must come from the stream
    names = set(plain.state_dict())
    merged = dict(full_tensors(engine.model))
    assert set(merged) == names
    plain.load_state_dict(merged)
    torch.testing.assert_close(log_probs(plain, batch), want, atol=1e-5, rtol=0)
    # the same through peft's own merge (unload_lora on a copy)
    import copy

    unloaded = unload_lora(copy.deepcopy(engine.model))
    assert set(unloaded.state_dict()) == names
    torch.testing.assert_close(log_probs(unloaded, batch), want, atol=1e-5, rtol=0)


def test_the_saved_adapter_loads_with_peft(tmp_path):
    """adapter_config.json + adapter_model.safetensors in PEFT's format: PeftModel.from_pretrained
    on the base model reproduces the trained log-probs."""
    from peft import PeftModel

    engine = trained_lora_engine()
    batch = make_batch()
    want = engine.compute(batch, LP)["log_probs"]
    out = save_adapter(
        adapter_tensors(engine.model.state_dict().items()),
        adapter_config(engine.model, "tiny"),
        tmp_path / "adapter",
    )
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    peft_model = PeftModel.from_pretrained(tiny_model(), out).eval()
    with torch.no_grad():
        got = forward_outputs(peft_model.base_model.model, batch, Layout(), outputs=LP)
    torch.testing.assert_close(got["log_probs"], want, atol=1e-5, rtol=0)
    # and back into otbrl: a fresh LoRA model started from the adapter
    again = add_lora(tiny_model(), LoraConfig(rank=99, alpha=1.0, adapter_path=str(out)))
    torch.testing.assert_close(log_probs(again, batch), want, atol=1e-6, rtol=0)


def test_bf16_mixed_lora_keeps_a_bf16_base_and_fp32_adapters():
    model = add_lora(
        tiny_model().to(torch.bfloat16), LoraConfig(rank=4, alpha=8.0), adapter_dtype=torch.float32
    )
    spec = EngineSpec(precision="bf16-mixed", micro=MicroBatchConfig(3))
    engine = TrainableEngine(model, actor(lr=5e-2), spec)
    engine.update(rl_batch(engine), _loss())
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {d for n, d in dtypes.items() if ".lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if ".lora_" not in n} == {torch.bfloat16}
    state = {v.dtype for s in engine.optimizer.state.values() for k, v in s.items() if k != "step"}
    assert state == {torch.float32}


def test_targets_that_name_nothing_list_the_linear_layers():
    names = linear_module_names(tiny_model())
    assert names == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    with pytest.raises(ValueError, match=r"target_modules: \['qkv'\].*\['down_proj'"):
        lora_model(target_modules=["qkv"])
    partial = lora_model(target_modules=["q_proj", "v_proj"])
    adapted = {n.split(".lora_A.")[0].rsplit(".", 1)[-1] for n, _ in partial.named_parameters()}
    assert adapted >= {"q_proj", "v_proj"} and "k_proj" not in adapted


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    small = build_tiny_model(root / "small", seed=0, hidden_size=32, intermediate_size=64)
    other = build_tiny_model(root / "other", seed=0, hidden_size=48, intermediate_size=64)
    model, _ = load_model_and_tokenizer(other)
    add_lora(model, LoraConfig(rank=4, alpha=8.0))
    adapter = save_adapter(
        adapter_tensors(model.state_dict().items()), adapter_config(model), root / "adapter"
    )
    return small, adapter


@pytest.mark.parametrize(
    ("extra", "key", "words"),
    [
        (["model.lora.target_modules=[qkv]"], "model.lora.target_modules", "q_proj"),
        (["model.lora.adapter_path={adapter}"], "model.lora.adapter_path", "another base"),
        (["actor.strategy=tp", "actor.tensor_parallel_size=2"], "model.lora.rank", "tensor"),
    ],
)
def test_bad_lora_settings_are_one_line_before_training(
    model_dirs, tmp_path, capsys, monkeypatch, extra, key, words
):
    small, adapter = model_dirs

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("otbrl.run.build.load_policy", no_model)
    monkeypatch.setenv("WORLD_SIZE", "2" if "actor.strategy=tp" in extra else "1")
    argv = [
        "train",
        f"model.path={small}",
        "data.task=arithmetic",
        "model.lora.rank=4",
        f"trainer.output_dir={tmp_path / 'run'}",
        *[e.format(adapter=adapter) for e in extra],
    ]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"'{key}'" in err and words in err, err


def test_lora_keys_need_a_rank():
    from otbrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"'model\.lora\.alpha' is set but 'model\.lora\.rank'"):
        load_config(None, ["model.lora.alpha=16"])
    with pytest.raises(ConfigError, match=r"adapter_config\.json"):
        load_config(None, ["model.lora.rank=4", "model.lora.adapter_path=/nonexistent"])


def test_lora_keys_follow_the_saved_adapter_or_are_refused(model_dirs, tmp_path, capsys):
    """A saved adapter fixes what trains: ``model.lora.rank=8`` with a rank-4 adapter trained
    rank 4 and recorded 8; now the contradiction is one line naming the key (exit 2), and the
    keys left at their defaults take the adapter's own values (the recorded config is true)."""
    from otbrl.config import load_config, to_dict
    from run_utils import refused

    small, adapter = model_dirs  # rank 4, alpha 8, every linear layer
    base = [
        "train",
        f"model.path={small}",
        "data.task=arithmetic",
        f"model.lora.adapter_path={adapter}",
    ]
    for key, value in (("rank", 8), ("alpha", 16.0), ("target_modules", "[q_proj]")):
        argv = [*base, f"trainer.output_dir={tmp_path / key}", f"model.lora.{key}={value}"]
        if key != "rank":
            argv.append("model.lora.rank=4")
        refused(argv, capsys, f"'model.lora.{key}'", "trained with")
    cfg = load_config(None, ["model.lora.rank=4", f"model.lora.adapter_path={adapter}"])
    lora = to_dict(cfg)["model"]["lora"]
    assert (lora["rank"], lora["alpha"], lora["dropout"]) == (4, 8.0, 0.0)
    saved = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    assert sorted(lora["target_modules"]) == sorted(saved) and len(saved) > 1
