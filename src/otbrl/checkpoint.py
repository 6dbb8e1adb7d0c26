"""Checkpoints that are complete or absent, restored exactly, and never unpickle arbitrary objects.

Layout of ``<ckpt_root>/step_<k>/``::

    config.json, generation_config.json, model.safetensors   model.save_pretrained()
    tokenizer.json, tokenizer_config.json, ...               tokenizer.save_pretrained()
    optimizer.pt, scheduler.pt     state_dict(), read back with torch.load(weights_only=True)
    trainer_state.json             plain values; tensors / arrays replaced by references into
    trainer_state.safetensors      ... this file (RNG states, counters, data position)
    config.yaml                    resolved run configuration
    checkpoint.json                step and format; written last, so its presence marks a
                                   complete directory

Everything is written into ``.tmp-step_<k>-*`` in the same folder, fsynced, then renamed to
``step_<k>``; a kill at any point leaves either the previous checkpoints or the new complete one.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from otbrl.logging import _fsync_dir, to_plain_dict

FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-step_"
_MARKER = "checkpoint.json"
# Files of ours that are not part of a Hugging Face model directory (left out by export).
_TRAINING_FILES = {
    "optimizer.pt",
    "scheduler.pt",
    "trainer_state.json",
    "trainer_state.safetensors",
    "config.yaml",
    _MARKER,
}


# ---------------------------------------------------------------------------------------------
# RNG state as safely serialisable values


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU and CUDA) RNG states, as values ``save_checkpoint`` stores."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": np.random.get_state(legacy=False),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of ``capture_rng_state``: the global streams continue where they were captured."""
    python = state["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss_next"]))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------
# trainer_state <-> JSON + safetensors


def _encode(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """JSON-ready copy of ``value``; tensors and arrays move to ``tensors`` by reference."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = value.detach().cpu().clone(memory_format=torch.contiguous_format)
        return {"__tensor__": name}
    if isinstance(value, np.ndarray):
        name = f"t{len(tensors)}"
        # torch lacks most unsigned dtypes; int64 holds uint32 (NumPy's RNG key) exactly.
        wide = value.astype(np.int64) if value.dtype.kind in "ui" else value
        tensors[name] = torch.from_numpy(np.ascontiguousarray(wide))
        return {"__ndarray__": name, "dtype": value.dtype.str}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value) and not any(k.startswith("__") for k in value):
            return {k: _encode(v, tensors, f"{where}[{k!r}]") for k, v in value.items()}
        return {
            "__items__": [
                [_encode(k, tensors, where), _encode(v, tensors, f"{where}[{k!r}]")]
                for k, v in value.items()
            ]
        }
    raise TypeError(
        f"{where}: cannot store a {type(value).__name__}; expected JSON values, tuples, "
        "dicts, tensors or numpy arrays"
    )


def _decode(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return tensors[value["__tensor__"]]
    if "__ndarray__" in value:
        return tensors[value["__ndarray__"]].numpy().astype(np.dtype(value["dtype"]))
    if "__tuple__" in value:
        return tuple(_decode(v, tensors) for v in value["__tuple__"])
    if "__items__" in value:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in value["__items__"]}
    return {k: _decode(v, tensors) for k, v in value.items()}


# ---------------------------------------------------------------------------------------------
# save / find / load


def _save_model(model: torch.nn.Module, out: Path) -> None:
    if hasattr(model, "save_pretrained"):
        from transformers.utils import logging as hf_logging

        # transformers draws its own "Writing model shards" bar; keep the console to ours.
        bar_was_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            model.save_pretrained(out)
        finally:
            if bar_was_on:
                hf_logging.enable_progress_bar()
    else:
        from safetensors.torch import save_model

        save_model(model, str(out / "model.safetensors"))


def _load_model_weights(model: torch.nn.Module, ckpt: Path) -> None:
    index = ckpt / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(ckpt / shard))
    own = model.state_dict()
    unexpected = sorted(set(state) - set(own))
    # Tied parameters (lm_head = embed_tokens) are stored once; a missing key is fine when it
    # shares storage with a loaded one.
    loaded_ptrs = {own[k].untyped_storage().data_ptr() for k in state if k in own}
    missing = sorted(
        k for k in set(own) - set(state) if own[k].untyped_storage().data_ptr() not in loaded_ptrs
    )
    if missing or unexpected:
        raise ValueError(
            f"model: checkpoint {ckpt} does not match the model "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    model.load_state_dict(state, strict=False)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _discard(ckpt: Path, root: Path) -> None:
    # Rename first: a kill during the slow delete must not leave a torn step_<k> that still
    # has its marker. The temp name is swept by the next save.
    grave = Path(tempfile.mkdtemp(dir=root, prefix=f"{_TMP_PREFIX}{ckpt.name}-old-"))
    os.replace(ckpt, grave / ckpt.name)
    shutil.rmtree(grave, ignore_errors=True)


def save_checkpoint(
    ckpt_root: str | Path,
    step: int,
    *,
    model: torch.nn.Module,
    tokenizer: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    trainer_state: Mapping[str, Any] | None = None,
    config: Any = None,
    keep_last: int | None = None,
) -> Path:
    """Write ``<ckpt_root>/step_<step>/`` atomically and return its path.

    ``trainer_state`` may nest dicts, lists, tuples, JSON scalars, tensors of any shape and
    NumPy arrays (e.g. ``capture_rng_state()``, a data loader's ``state_dict()``); it is stored
    as JSON plus safetensors and comes back from ``load_checkpoint`` with the same types.
    ``keep_last=N`` deletes the oldest complete checkpoints beyond the newest N afterwards.
    Temp directories left by a killed save are removed. Only one process should save.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step: expected an int >= 0, got {step!r}")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last: expected None or an int >= 1, got {keep_last!r}")
    if trainer_state is not None and not isinstance(trainer_state, Mapping):
        raise TypeError(f"trainer_state: expected a dict, got {type(trainer_state).__name__}")
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f"{_TMP_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)

    # Encode first: a bad trainer_state fails before anything touches the disk.
    tensors: dict[str, torch.Tensor] = {}
    state_json = json.dumps(_encode(dict(trainer_state or {}), tensors, "trainer_state"))
    config_plain = to_plain_dict(config) if config is not None else None

    final = root / f"step_{step}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f"{_TMP_PREFIX}{step}-"))
    try:
        _save_model(model, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        if scheduler is not None:
            torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / "trainer_state.json").write_text(state_json)
        save_file(tensors, str(tmp / "trainer_state.safetensors"))
        if config_plain is not None:
            import yaml  # a dependency of omegaconf

            (tmp / "config.yaml").write_text(yaml.safe_dump(config_plain, sort_keys=False))
        meta = {"format": FORMAT_VERSION, "step": step}
        (tmp / _MARKER).write_text(json.dumps(meta) + "\n")
        _fsync_tree(tmp)
        if final.exists():  # saving the same step again (e.g. after a resume): swap it out
            _discard(final, root)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last is not None:
        for old_ckpt in list_checkpoints(root)[:-keep_last]:
            _discard(old_ckpt, root)
    return final


def list_checkpoints(ckpt_root: str | Path) -> list[Path]:
    """Complete ``step_<k>`` directories under ``ckpt_root``, oldest step first ([] if none)."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and (child / _MARKER).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None; temp and partial dirs ignored."""
    checkpoints = list_checkpoints(ckpt_root)
    return checkpoints[-1] if checkpoints else None


def checkpoint_step(path: str | Path) -> int:
    """The step a complete checkpoint directory was saved at."""
    return int(json.loads((_require_complete(path) / _MARKER).read_text())["step"])


def _require_complete(path: str | Path) -> Path:
    ckpt = Path(path)
    if not (ckpt / _MARKER).is_file():
        raise ValueError(
            f"path: expected a complete checkpoint directory (step_<k> with {_MARKER}), "
            f"got {ckpt}; use latest_checkpoint(ckpt_root) to find one"
        )
    return ckpt


def _torch_load(path: Path) -> Any:
    # weights_only: the restricted unpickler (tensors, dicts, lists, numbers); never arbitrary.
    return torch.load(path, map_location="cpu", weights_only=True)


def load_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
) -> dict[str, Any]:
    """Restore weights (and optimizer / scheduler state when given) in place; return trainer_state.

    The returned dict equals the ``trainer_state`` that was saved (tensors, arrays and tuples
    included). Raises ``ValueError`` for an incomplete directory, weights that do not match the
    model, or an optimizer / scheduler requested but not saved.
    """
    ckpt = _require_complete(path)
    _load_model_weights(model, ckpt)
    for obj, name in ((optimizer, "optimizer"), (scheduler, "scheduler")):
        if obj is None:
            continue
        file = ckpt / f"{name}.pt"
        if not file.is_file():
            raise ValueError(f"{name}: checkpoint {ckpt} holds no {name} state ({file.name})")
        obj.load_state_dict(_torch_load(file))
    tensors = load_file(ckpt / "trainer_state.safetensors")
    return _decode(json.loads((ckpt / "trainer_state.json").read_text()), tensors)


def export_checkpoint(path: str | Path, out_dir: str | Path) -> Path:
    """Copy the model and tokenizer files of a checkpoint to ``out_dir``: a plain HF directory.

    ``AutoModelForCausalLM.from_pretrained(out_dir)`` and ``AutoTokenizer.from_pretrained``
    load the result. ``out_dir`` must not exist or be empty; it appears atomically.
    """
    ckpt = _require_complete(path)
    if not (ckpt / "config.json").is_file():
        raise ValueError(f"path: {ckpt} holds no Hugging Face model (no config.json)")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"out_dir: expected a new or empty directory, got {out} (not empty)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".tmp-{out.name}-"))
    try:
        for item in ckpt.iterdir():
            if item.name in _TRAINING_FILES:
                continue
            if item.is_dir():
                shutil.copytree(item, tmp / item.name)
            else:
                shutil.copy2(item, tmp / item.name)
        _fsync_tree(tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
