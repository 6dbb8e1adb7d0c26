"""One checkpoint format for every engine and world size: complete or absent, never unpickled.

Layout of ``<ckpt_root>/step_<k>/``::

    config.json, generation_config.json, model.safetensors   the policy as a plain HF model
    tokenizer.json, tokenizer_config.json, ...               (``otbrl export`` copies these)
    critic/config.json, critic/model.safetensors             the value model, when there is one
    state/<engine>/shard-*.safetensors    optimizer state, one shard file per rank
                                          (torch.distributed.checkpoint, safetensors-backed:
                                          offsets in JSON headers, read by any world size)
    state/trainer_state.json + .safetensors   step, data position, RNG, schedulers, optimizer
                                              hyper-parameters (plain values + tensors)
    config.yaml                    resolved run configuration
    checkpoint.json                step and format; written last, so its presence marks a
                                   complete directory

Weights are written once, as full tensors by rank 0, and loaded back with
``HuggingFaceStorageReader`` into whatever layout the resuming run has (one process, FSDP2, TP,
another world size). Nothing is ever unpickled: safetensors, JSON, and
``torch.load(weights_only=True)`` nowhere needed. Everything is written into ``.tmp-step_<k>``
in the same folder, fsynced, then renamed to ``step_<k>``; a kill at any point leaves either
the previous checkpoints or the new complete one.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from otbrl.run.outputs import fsync_dir, fsync_tree, to_plain_dict

FORMAT_VERSION = 2
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-step_"
_MARKER = "checkpoint.json"
STATE_DIR = "state"
# What `otbrl export` leaves out of a step directory: everything but the policy's HF files.
_TRAINING_ENTRIES = {STATE_DIR, "critic", "config.yaml", _MARKER}

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


def _full_state_dict(engine) -> dict[str, torch.Tensor]:
    """The model's full tensors on rank 0 (collective; {} on other ranks)."""
    if engine.world.mesh is None:
        return {k: v.detach().cpu() for k, v in engine.model.state_dict().items()}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(engine.model, options=options)


def _write_hf_model(model: torch.nn.Module, state: dict[str, torch.Tensor], out: Path) -> None:
    """config.json (+ generation_config.json) and model.safetensors from full tensors."""
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(out)
    seen: set[int] = set()
    tensors = {}
    for name, value in state.items():
        value = value.contiguous()
        ptr = value.untyped_storage().data_ptr()
        # tied weights share storage, which safetensors refuses: store each name's own copy
        tensors[name] = value.clone() if ptr in seen else value
        seen.add(ptr)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _optimizer_tensors(engine) -> tuple[dict[str, torch.Tensor], list]:
    """The optimizer state flattened to ``state.<param>.<key>`` tensors (sharded like the
    parameters) and its param groups (plain values)."""
    osd = get_optimizer_state_dict(engine.model, engine.optimizer)
    flat = {f"state.{p}.{k}": v for p, d in osd["state"].items() for k, v in d.items()}
    return flat, osd["param_groups"]


def _dcp(method, state: dict, engine, **kwargs) -> None:
    """``dcp.save`` / ``dcp.load`` for this engine's world (no process group in one process)."""
    with warnings.catch_warnings():
        # one process: torch warns that it assumes what we ask for
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        method(state, no_dist=engine.world.mesh is None, **kwargs)


def save_checkpoint(
    ckpt_root: str | Path,
    step: int,
    *,
    engines: Mapping[str, Any],
    tokenizer: Any = None,
    trainer_state: Mapping[str, Any] | None = None,
    config: Any = None,
    keep_last: int | None = None,
) -> Path:
    """Write ``<ckpt_root>/step_<step>/`` atomically; collective (every rank calls it).

    ``engines``: name -> ``otbrl.engine.Engine``; ``"policy"`` is stored as the step
    directory's HF model, any other (``"critic"``) in a subfolder of that name; engines with an
    optimizer get their optimizer shards under ``state/<name>/``. ``trainer_state`` may nest
    dicts, lists, tuples, JSON scalars, tensors and NumPy arrays; it comes back from
    ``load_checkpoint`` with the same types. ``keep_last=N`` deletes the oldest complete
    checkpoints beyond the newest N afterwards. Temp directories left by a killed save are
    removed. Returns the final path.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step: expected an int >= 0, got {step!r}")
    if "policy" not in engines:
        raise ValueError(f"engines: expected a 'policy' engine, got {sorted(engines)}")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last: expected None or an int >= 1, got {keep_last!r}")
    if trainer_state is not None and not isinstance(trainer_state, Mapping):
        raise TypeError(f"trainer_state: expected a dict, got {type(trainer_state).__name__}")
    world = engines["policy"].world
    root = Path(ckpt_root)
    final, tmp = root / f"step_{step}", root / f"{_TMP_PREFIX}{step}"
    state: dict[str, Any] = {"trainer": dict(trainer_state or {}), "engines": {}}
    optimizers = {}
    for name, engine in engines.items():
        state["engines"][name] = engine.state_dict()
        if engine.optimizer is not None:  # collective: every rank gathers its shards' view
            optimizers[name], state["engines"][name]["param_groups"] = _optimizer_tensors(engine)
    tensors: dict[str, torch.Tensor] = {}
    # Encode first: a bad trainer_state fails before anything touches the disk.
    state_json = json.dumps(_encode(state, tensors, "trainer_state"))
    if world.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"{_TMP_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        (tmp / STATE_DIR).mkdir(parents=True)
    world.barrier()
    try:
        for name, engine in engines.items():
            full = _full_state_dict(engine)
            if world.is_main:
                _write_hf_model(engine.model, full, tmp if name == "policy" else tmp / name)
            del full
            if name in optimizers:
                writer = HuggingFaceStorageWriter(
                    str(tmp / STATE_DIR / name), save_distributed=True
                )
                _dcp(dcp.save, optimizers[name], engine, storage_writer=writer)
        world.barrier()
        if world.is_main:
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            (tmp / STATE_DIR / "trainer_state.json").write_text(state_json)
            save_file(tensors, str(tmp / STATE_DIR / "trainer_state.safetensors"))
            if config is not None:
                import yaml  # a dependency of omegaconf

                (tmp / "config.yaml").write_text(
                    yaml.safe_dump(to_plain_dict(config), sort_keys=False)
                )
            meta = {"format": FORMAT_VERSION, "step": step, "world_size": world.size}
            (tmp / _MARKER).write_text(json.dumps(meta) + "\n")
            fsync_tree(tmp)
            if final.exists():  # saving the same step again (e.g. after a resume): swap it out
                _discard(final, root)
            os.replace(tmp, final)
            fsync_dir(root)
            for old in list_checkpoints(root)[: -keep_last or None] if keep_last else []:
                _discard(old, root)
    except BaseException:
        if world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    world.barrier()
    return final


def _discard(ckpt: Path, root: Path) -> None:
    # Rename first: a kill during the slow delete must not leave a torn step_<k> that still
    # has its marker. The temp name is swept by the next save.
    grave = Path(tempfile.mkdtemp(dir=root, prefix=f"{_TMP_PREFIX}{ckpt.name}-old-"))
    os.replace(ckpt, grave / ckpt.name)
    shutil.rmtree(grave, ignore_errors=True)


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
    meta = json.loads((ckpt / _MARKER).read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"path: {ckpt} has checkpoint format {meta.get('format')}, this otbrl reads "
            f"format {FORMAT_VERSION}"
        )
    return ckpt


def _load_weights(engine, directory: Path) -> None:
    """Full HF tensors -> the engine's model, in its own layout (sharded or not)."""
    if not (directory / "model.safetensors").is_file():
        raise ValueError(f"checkpoint: {directory} holds no model.safetensors")
    state = get_model_state_dict(engine.model)
    saved = HuggingFaceStorageReader(str(directory)).read_metadata().state_dict_metadata
    missing, unexpected = sorted(set(state) - set(saved)), sorted(set(saved) - set(state))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint: {directory} does not match the model (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]})"
        )
    for name, value in state.items():
        if tuple(saved[name].size) != tuple(value.shape):  # a DTensor reports its global shape
            raise ValueError(
                f"checkpoint: {directory} does not match the model: {name} has shape "
                f"{list(saved[name].size)} there, {list(value.shape)} in the model"
            )
    _dcp(dcp.load, state, engine, storage_reader=HuggingFaceStorageReader(str(directory)))
    set_model_state_dict(engine.model, state)


_ADAMW_SLOTS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # AdamW's own order


def _slot_order(key: str) -> tuple:
    name, _, slot = key[len("state.") :].rpartition(".")
    rank = _ADAMW_SLOTS.index(slot) if slot in _ADAMW_SLOTS else len(_ADAMW_SLOTS)
    return name, rank, slot


def _load_optimizer(engine, directory: Path, param_groups: list) -> None:
    """Optimizer shards -> the engine's AdamW, resharded to its layout."""
    reader = HuggingFaceStorageReader(str(directory))
    keys = reader.read_metadata().state_dict_metadata
    params = dict(engine.model.named_parameters())
    flat = {}
    for key in keys:
        name, _, slot = key[len("state.") :].rpartition(".")
        if name not in params:
            raise ValueError(f"checkpoint: optimizer state for unknown parameter {name!r}")
        param = params[name].detach()
        # AdamW's moments are shaped (and sharded) like the parameter; its step is a scalar
        flat[key] = (
            torch.zeros((), dtype=torch.float32) if slot == "step" else torch.zeros_like(param)
        )
    _dcp(dcp.load, flat, engine, storage_reader=HuggingFaceStorageReader(str(directory)))
    nested: dict[str, dict[str, torch.Tensor]] = {}
    for key in sorted(flat, key=_slot_order):
        name, _, slot = key[len("state.") :].rpartition(".")
        nested.setdefault(name, {})[slot] = flat[key]
    set_optimizer_state_dict(
        engine.model, engine.optimizer, {"state": nested, "param_groups": param_groups}
    )


def load_checkpoint(path: str | Path, *, engines: Mapping[str, Any]) -> dict[str, Any]:
    """Restore the engines (weights, optimizer, scheduler, generator) in place from a complete
    checkpoint, whatever world size or engine wrote it; returns the trainer_state.

    Collective. Raises ``ValueError`` for an incomplete directory or one that does not match the
    engines (another model, an engine the checkpoint does not hold).
    """
    ckpt = _require_complete(path)
    state_dir = ckpt / STATE_DIR
    tensors = load_file(state_dir / "trainer_state.safetensors")
    state = _decode(json.loads((state_dir / "trainer_state.json").read_text()), tensors)
    for name, engine in engines.items():
        if name not in state["engines"]:
            raise ValueError(f"checkpoint: {ckpt} holds no {name!r} engine")
        _load_weights(engine, ckpt if name == "policy" else ckpt / name)
        saved = dict(state["engines"][name])
        if engine.optimizer is not None:
            _load_optimizer(engine, state_dir / name, saved.pop("param_groups"))
        engine.load_state_dict(saved)
    return state["trainer"]


def export_checkpoint(path: str | Path, out_dir: str | Path) -> Path:
    """Copy the policy's model and tokenizer files of a checkpoint to ``out_dir``.

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
            if item.name in _TRAINING_ENTRIES:
                continue
            if item.is_dir():
                shutil.copytree(item, tmp / item.name)
            else:
                shutil.copy2(item, tmp / item.name)
        fsync_tree(tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
