"""``otbrl export``: a checkpoint's policy as a plain Hugging Face directory, checked by loading it.

A full fine-tuning checkpoint's HF files are copied; a LoRA checkpoint's adapter is merged into
its base model, or written alone in PEFT's format. Everything is checked (the checkpoint
verified, the copies against its manifest, the result loaded back) before the directory appears,
atomically; the checkpoint layout itself is ``otbrl.store.checkpoint``'s.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from otbrl.models.config import LoraConfig
from otbrl.models.hf import quiet_loading
from otbrl.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, add_lora, unload_lora
from otbrl.store.checkpoint import (
    ADAPTER_DIR,
    MARKER,
    STATE_DIR,
    read_marker,
    resolve_checkpoint,
    verify_checkpoint,
)
from otbrl.store.files import apply_umask, fsync_dir, fsync_tree, make_temp_dir
from otbrl.store.integrity import verify_manifest

__all__ = ["export_checkpoint"]

# What an export leaves out of a step directory: everything but the policy's HF files.
_TRAINING_ENTRIES = {STATE_DIR, "critic", "config.yaml", MARKER}


def export_checkpoint(path: str | Path, out_dir: str | Path, *, adapter_only: bool = False) -> Path:
    """Write the policy of a verified checkpoint to ``out_dir`` as a plain Hugging Face
    directory with its tokenizer (``path``: a checkpoint, or a run directory for its newest
    verified one).

    A full fine-tuning checkpoint's files are copied. A LoRA checkpoint's adapter is merged
    into its base model (``adapter_config.json``'s ``base_model_name_or_path``: the model the
    run started from); ``adapter_only=True`` writes the PEFT adapter instead (its two files and
    the tokenizer), loadable with ``peft.PeftModel.from_pretrained``. The checkpoint is verified
    first, the copies are checked against its manifest, and the result is loaded back with the
    HF Auto classes (a merged or copied model: its tensors compared with the file's) before it
    appears, atomically, at ``out_dir`` (which must not exist or be empty). Raises
    ``ValueError`` naming the problem; nothing is left behind then.
    """
    ckpt = resolve_checkpoint(path)
    verify_checkpoint(ckpt)
    if not (ckpt / "config.json").is_file():
        raise ValueError(f"path: {ckpt} holds no Hugging Face model (no config.json)")
    lora = (ckpt / ADAPTER_DIR / ADAPTER_CONFIG).is_file()
    if adapter_only and not lora:
        raise ValueError(f"--adapter-only: {ckpt} was trained without LoRA (no adapter/)")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"out_dir: expected a new or empty directory, got {out} (not empty)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(out.parent, f".tmp-{out.name}-")
    try:
        for item in ckpt.iterdir():
            if item.name in _TRAINING_ENTRIES or item.name == ADAPTER_DIR:
                continue
            if lora and (adapter_only and item.name.startswith(("config", "generation"))):
                continue
            if item.is_dir():
                shutil.copytree(item, tmp / item.name)
            else:
                shutil.copy2(item, tmp / item.name)
        files = read_marker(ckpt)["files"]
        copied = {
            k: v
            for k, v in files.items()
            if k.split("/")[0] not in _TRAINING_ENTRIES and (tmp / k).exists()
        }
        verify_manifest(tmp, copied)
        if adapter_only:
            for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
                shutil.copy2(ckpt / ADAPTER_DIR / name, tmp / name)
            _check_adapter_loads(tmp)
        elif lora:
            _write_merged(ckpt / ADAPTER_DIR, tmp)
            _check_loads(tmp)
        else:
            _check_loads(tmp)
        apply_umask(tmp)  # copy2 keeps the source modes; the export gets this user's umask
        fsync_tree(tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _check_loads(directory: Path) -> None:
    """Load an exported directory with the HF Auto classes; its weights must be the file's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with quiet_loading():  # no "Loading weights" bar: the export says what it did
            model = AutoModelForCausalLM.from_pretrained(directory)
        if (directory / "tokenizer_config.json").is_file():
            AutoTokenizer.from_pretrained(directory)
    except Exception as err:  # any failure of the HF loaders means the export is unusable
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(
            f"out_dir: the exported model does not load with the HF Auto classes: {first}"
        ) from err
    loaded = model.state_dict()
    for name, value in load_file(directory / "model.safetensors").items():
        if name not in loaded or not torch.equal(loaded[name].to(value.dtype), value):
            raise ValueError(f"out_dir: {name} loads back different from the exported file")


def _write_merged(adapter_dir: Path, out: Path) -> None:
    """The base model with the adapter merged in, saved as a plain HF model into ``out``."""
    from transformers import AutoModelForCausalLM

    base = json.loads((adapter_dir / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base or not Path(base).is_dir():
        raise ValueError(
            f"path: the adapter's base model {base!r} (the directory the run started from) is "
            "not there: the merged export needs it; --adapter-only exports the adapter alone"
        )
    with quiet_loading():  # transformers' loading and "Writing model shards" bars
        model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
        # the adapter's own rank, alpha and targets are read from its directory
        lora = LoraConfig(rank=1, adapter_path=str(adapter_dir))
        add_lora(model, lora, adapter_dtype=torch.float32)
        unload_lora(model)
        model.save_pretrained(out)


def _check_adapter_loads(directory: Path) -> None:
    """The exported adapter's config and tensors read back with peft."""
    from peft import LoraConfig
    from safetensors import safe_open

    try:
        LoraConfig.from_pretrained(str(directory))
        with safe_open(str(directory / ADAPTER_WEIGHTS), framework="pt") as f:
            if not list(f.keys()):
                raise ValueError("no tensors")
    except Exception as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"out_dir: the exported adapter does not load with peft: {first}") from err
