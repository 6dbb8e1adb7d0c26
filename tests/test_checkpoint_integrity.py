"""Checkpoints verified before use: flipped bytes, truncation, missing or added files are found
and named; the newest intact checkpoint is found; export verifies, checks its copy and loads
it back; folders and files get the user's umask."""

import json
import os
import stat

import pytest
import torch

from ckpt_utils import flip_byte, reseal, truncate
from otbrl import cli
from otbrl.config import load_config
from otbrl.engine.optim import OptimConfig
from otbrl.engine.state import EngineState
from otbrl.engine.trainable import TrainableEngine
from otbrl.models import build_tiny_model, load_model_and_tokenizer
from otbrl.report.metrics_log import MetricsLogger
from otbrl.run.claim import claim_run_dir
from otbrl.store.checkpoint import (
    IntegrityError,
    latest_verified_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from otbrl.store.export import export_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny"), hidden_size=16, intermediate_size=32, num_hidden_layers=1
    )


def engine_and_tokenizer(model_dir):
    model, tokenizer = load_model_and_tokenizer(model_dir)
    return TrainableEngine(model, OptimConfig(lr=1e-3)), tokenizer


def saved(model_dir, root, steps=(1,)):
    engine, tokenizer = engine_and_tokenizer(model_dir)
    for step in steps:
        save_checkpoint(root, step, engines={"policy": EngineState(engine)}, tokenizer=tokenizer)
    return engine


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda c: flip_byte(c / "model.safetensors"), r"'model\.safetensors' does not match"),
        (lambda c: truncate(c / "state/trainer_state.json"), "has .* bytes, the manifest says"),
        (lambda c: (c / "tokenizer.json").unlink(), r"'tokenizer\.json' is missing"),
        (lambda c: (c / "state" / "extra.safetensors").write_bytes(b"x"), "not in the manifest"),
        (lambda c: (c / "checkpoint.json").write_text("{torn"), "not valid JSON"),
    ],
)
def test_damage_is_found_and_named(model_dir, tmp_path, damage, match):
    engine = saved(model_dir, tmp_path)
    ckpt = tmp_path / "step_1"
    assert verify_checkpoint(ckpt) == 1
    damage(ckpt)
    with pytest.raises(IntegrityError, match=match):
        verify_checkpoint(ckpt)
    with pytest.raises(IntegrityError, match=match):
        load_checkpoint(ckpt, engines={"policy": EngineState(engine)})


def test_random_bytes_in_the_weights_do_not_load(model_dir, tmp_path):
    """The issue's probe: random bytes written into model.safetensors loaded without
    complaint (same size, valid header kept)."""
    engine = saved(model_dir, tmp_path)
    weights = tmp_path / "step_1" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-256:] = os.urandom(256)  # inside the tensor data, after the JSON header
    weights.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"model\.safetensors"):
        load_checkpoint(tmp_path / "step_1", engines={"policy": EngineState(engine)})


def test_newest_verified_checkpoint_passes_over_damaged_ones(model_dir, tmp_path):
    saved(model_dir, tmp_path, steps=(1, 2, 3, 4))
    truncate(tmp_path / "step_4" / "model.safetensors")
    flip_byte(tmp_path / "step_3" / "state" / "trainer_state.safetensors")
    (tmp_path / "step_5").mkdir()  # an interrupted copy: no marker
    found, skipped = latest_verified_checkpoint(tmp_path)
    assert found == tmp_path / "step_2"
    assert [p.name for p, _ in skipped] == ["step_5", "step_4", "step_3"]
    assert "complete checkpoint" in skipped[0][1] and "bytes" in skipped[1][1]
    assert "trainer_state.safetensors" in skipped[2][1]
    assert latest_verified_checkpoint(tmp_path / "none") == (None, [])


def test_an_older_format_is_refused_naming_it(model_dir, tmp_path):
    saved(model_dir, tmp_path)
    marker = tmp_path / "step_1" / "checkpoint.json"
    meta = json.loads(marker.read_text())
    marker.write_text(json.dumps({"format": 2, "step": meta["step"]}))
    with pytest.raises(ValueError, match="format 2, this otbrl reads format 3"):
        verify_checkpoint(tmp_path / "step_1")


def test_export_of_a_damaged_checkpoint_writes_nothing(model_dir, tmp_path, capsys):
    """The issue's probe: exporting a truncated checkpoint printed "exported" and left a
    directory that does not load."""
    saved(model_dir, tmp_path / "ckpt")
    ckpt = tmp_path / "ckpt" / "step_1"
    truncate(ckpt / "model.safetensors")
    out = tmp_path / "export"
    capsys.readouterr()  # the HF loader's progress bar of the save above
    assert cli.main(["export", str(ckpt), str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "model.safetensors" in err and "exported" not in err and "\n" not in err
    assert not out.exists() and list(tmp_path.iterdir()) == [tmp_path / "ckpt"]


def test_export_of_a_run_directory_takes_its_newest_verified_checkpoint(
    model_dir, tmp_path, capsys
):
    """`otbrl export RUN_DIR OUT` answered with a Python API name; it exports the newest
    checkpoint that verifies (step_3 is damaged: step_2) and says which one it took."""
    run = tmp_path / "run"
    saved(model_dir, run / "checkpoints", steps=(1, 2, 3))
    truncate(run / "checkpoints" / "step_3" / "model.safetensors")
    capsys.readouterr()
    assert cli.main(["export", str(run), str(tmp_path / "out")]) == 0
    said = capsys.readouterr()
    assert "step_2" in said.out
    assert "Loading weights" not in said.err  # transformers' bar of the load-back check
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "llama"
    (tmp_path / "empty").mkdir()
    assert cli.main(["export", str(tmp_path / "empty"), str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err.strip()
    assert "neither a checkpoint" in err and "\n" not in err


def test_export_is_loaded_back_before_it_appears(model_dir, tmp_path):
    engine = saved(model_dir, tmp_path / "ckpt")
    ckpt = tmp_path / "ckpt" / "step_1"
    # a config that no longer fits the weights, resealed so that verification passes: only
    # loading the export back finds it
    config = json.loads((ckpt / "config.json").read_text())
    config["vocab_size"] += 7
    (ckpt / "config.json").write_text(json.dumps(config))
    reseal(ckpt)
    with pytest.raises(ValueError, match="does not load with the HF Auto classes"):
        export_checkpoint(ckpt, tmp_path / "export")
    assert not (tmp_path / "export").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temp dir left
    # an intact one exports, and what appears is the model that was saved
    good = tmp_path / "good"
    save_checkpoint(
        good,
        2,
        engines={"policy": EngineState(engine)},
        tokenizer=engine_and_tokenizer(model_dir)[1],
    )
    out = export_checkpoint(good / "step_2", tmp_path / "export")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out)
    for name, value in engine.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def _modes(root):
    return {
        p.relative_to(root).as_posix(): stat.S_IMODE(p.stat().st_mode)
        for p in [root, *root.rglob("*")]
    }


def test_folders_and_files_follow_the_umask(model_dir, tmp_path):
    """mkdtemp made checkpoint and export folders 0700 and mkstemp made run files 0600: a
    team's shared storage could not read them."""
    previous = os.umask(0o027)
    try:
        root = tmp_path / "run"
        run = claim_run_dir(load_config(None, [f"trainer.output_dir={root}"]))
        with MetricsLogger(root, backends=["jsonl"], total_steps=1, config={"a": 1}) as log:
            log.log(1, {"x": 1.0})
            log.summary({"steps": 1})
        run.release()
        saved(model_dir, root / "checkpoints", steps=(1, 1))  # the re-save swaps a folder out
        export_checkpoint(root / "checkpoints" / "step_1", tmp_path / "export")
        for top in (root, tmp_path / "export"):
            for rel, mode in _modes(top).items():
                is_dir = (top / rel).is_dir()
                assert mode == (0o750 if is_dir else 0o640), (top / rel, oct(mode))
    finally:
        os.umask(previous)
