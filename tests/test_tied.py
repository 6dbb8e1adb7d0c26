"""The tied-weights rule (``otbrl.models.tied``): every weight stream carries each parameter
once, under the name ``save_pretrained`` keeps; checkpoints follow it and older ones (which held
the alias too) still load. Checked against transformers' own files on the zoo's shapes."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from ckpt_utils import reseal
from otbrl.models.tied import tied_aliases, untied_names
from zoo import ZOO, ZOO_NAMES, build_standin


@pytest.fixture(scope="module")
def zoo_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tied")
    return {name: build_standin(name, root / name) for name in ZOO_NAMES}


@pytest.mark.parametrize("shape", ZOO_NAMES)
def test_the_kept_names_are_the_ones_transformers_saves(zoo_dirs, shape):
    model = AutoModelForCausalLM.from_pretrained(zoo_dirs[shape])
    tied = ZOO[shape]["config"]["tie_word_embeddings"]
    assert tied_aliases(model) == ({"lm_head.weight": "model.embed_tokens.weight"} if tied else {})
    with safe_open(str(zoo_dirs[shape] / "model.safetensors"), "pt") as f:
        saved = list(f.keys())
    assert sorted(untied_names(model)) == sorted(saved)
    assert list(untied_names(model)) == [k for k in model.state_dict() if k in saved]


def _engine(model, **settings):
    from otbrl.engine.optim import OptimConfig
    from otbrl.engine.spec import EngineSpec, MicroBatchConfig
    from otbrl.engine.trainable import TrainableEngine

    spec = EngineSpec(micro=MicroBatchConfig(4))
    return TrainableEngine(model, OptimConfig(lr=1e-3, **settings), spec)


def _state(model):
    """What a checkpoint saves and restores of ``_engine(model)`` (``EngineState``)."""
    from otbrl.engine.state import EngineState

    return EngineState(_engine(model))


def test_every_stream_carries_a_tied_parameter_once(zoo_dirs):
    from otbrl.models.config import LoraConfig
    from otbrl.models.lora import add_lora
    from otbrl.models.weights import full_tensors

    model = AutoModelForCausalLM.from_pretrained(zoo_dirs["qwen2.5"])
    names = untied_names(model)
    stream = list(full_tensors(_engine(model).model))
    assert [n for n, _ in stream] == names
    assert len({t.data_ptr() for _, t in stream}) == len(stream)  # no tensor twice
    # a LoRA model's merged stream: the plain model's names, the tied one once
    lora = add_lora(
        AutoModelForCausalLM.from_pretrained(zoo_dirs["qwen2.5"]), LoraConfig(rank=4, alpha=8)
    )
    merged = [n for n, _ in full_tensors(_engine(lora).model)]
    assert sorted(merged) == sorted(names)
    # the shared tensor is the embedding, and the loaded copy re-ties from it
    embed = dict(stream)["model.embed_tokens.weight"]
    assert embed.data_ptr() == model.lm_head.weight.data_ptr()


def test_a_checkpoint_that_holds_the_alias_still_loads(zoo_dirs, tmp_path):
    """Checkpoints written before the rule hold ``lm_head.weight`` too: it is the same tensor,
    so loading ignores it; the new ones leave it out, and either loads to the same weights."""
    from otbrl.store.checkpoint import load_checkpoint, save_checkpoint

    trained = AutoModelForCausalLM.from_pretrained(zoo_dirs["qwen2.5"])
    with torch.no_grad():
        trained.model.embed_tokens.weight.add_(1.0)  # distinguishable from the fresh copy
    ckpt = save_checkpoint(tmp_path / "ckpt", 1, engines={"policy": _state(trained)})
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # noqa: SIM118 (safe_open has no __iter__)
    for with_alias in (False, True):
        if with_alias:  # rewrite the file as the old format did: both names
            state = {k: v.clone() for k, v in trained.state_dict().items()}
            save_file(state, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
            reseal(ckpt)
        fresh = AutoModelForCausalLM.from_pretrained(zoo_dirs["qwen2.5"])
        load_checkpoint(ckpt, engines={"policy": _state(fresh)})
        assert torch.equal(fresh.model.embed_tokens.weight, trained.model.embed_tokens.weight)
        assert fresh.lm_head.weight is fresh.model.embed_tokens.weight  # still tied
