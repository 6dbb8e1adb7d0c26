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
    checkpoint.json                step, format, and the size and SHA-256 of every other file;
                                   written last, so its presence marks a complete directory

Weights are written once, as full tensors by rank 0, and loaded back with
``HuggingFaceStorageReader`` into whatever layout the resuming run has (one process, FSDP2, TP,
another world size). A save costs no second copy of the state: every file is streamed tensor by
tensor (``otbrl.store.tensor_file``) — the weights gathered one full tensor at a time (under a
mesh every rank takes part in each gather, rank 0 writes), each rank's optimizer shard straight
from the optimizer's own tensors, with the global offsets of its chunks in the header as
``torch.distributed.checkpoint`` records them. Nothing is ever unpickled: safetensors and JSON
only (DCP's pickled ``.metadata`` is never written nor read: ``HuggingFaceStorageReader`` takes
the shard offsets from the safetensors headers). Everything is written into ``.tmp-step_<k>``
in the same folder, fsynced, then renamed to ``step_<k>``; a kill at any point leaves either the
previous checkpoints or the new complete one. Loading verifies every file against
``checkpoint.json`` first (``verify_checkpoint``), so flipped bits or a truncated file are an
error naming the file, and ``latest_verified_checkpoint`` falls back to the newest checkpoint
that is intact.

This module owns the files; the engines own their state: weights, adapters and optimizer shards
come from and go back through each trainable engine's checkpoint adapter
(``otbrl.engine.state.EngineState``), read with ``dcp.load``. ``otbrl.store.export`` turns a
checkpoint into a plain HF directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint import HuggingFaceStorageReader

from otbrl.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, save_adapter
from otbrl.store.files import apply_umask, fsync_dir, fsync_tree, make_temp_dir
from otbrl.store.integrity import IntegrityError, file_manifest, verify_manifest
from otbrl.store.plain import to_plain_dict
from otbrl.store.state_codec import capture_rng_state, decode_state, encode_state, restore_rng_state
from otbrl.store.tensor_file import safetensors_order, write_safetensors

__all__ = [
    "IntegrityError",
    "capture_rng_state",
    "checkpoint_step",
    "latest_checkpoint",
    "latest_verified_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_marker",
    "resolve_checkpoint",
    "restore_rng_state",
    "save_checkpoint",
    "verify_checkpoint",
]

FORMAT_VERSION = 3  # 3: checkpoint.json lists every file with its size and SHA-256
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-step_"
MARKER = "checkpoint.json"
STATE_DIR = "state"
# A LoRA policy is stored as its adapter alone, in PEFT's format (the frozen base is model.path)
ADAPTER_DIR = "adapter"


def _write_hf_model(engine, out: Path, is_main: bool) -> None:
    """config.json (+ generation_config.json) and model.safetensors, streamed: one full tensor
    at a time is gathered (collective under a mesh: every rank drains the iterator), written by
    the main rank and dropped — no rank ever holds a second copy of the model."""
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        for config in engine.model_configs():
            config.save_pretrained(out)
    if engine.lora is not None:
        # the adapter alone, in PEFT's format (the frozen base is not written: it is the model
        # the run started from, adapter_config.json's base_model_name_or_path)
        tensors = engine.adapter_tensors()  # collective; the adapters only
        if is_main:
            save_adapter(tensors, engine.adapter_config(), out / ADAPTER_DIR)
        return
    # a DTensor reports its global shape and dtype: the header needs no gather. Tied aliases
    # are left out (otbrl.models.tied), as save_pretrained does: HF re-ties them on load.
    specs = safetensors_order((k, v.dtype, v.shape) for k, v in engine.weights().items())
    tensors = engine.state_tensors([name for name, _, _ in specs])
    if is_main:
        write_safetensors(out / "model.safetensors", specs, tensors, metadata={"format": "pt"})
    else:
        for _ in tensors:
            pass


def _write_optimizer_shard(engine, chunks: Mapping[str, tuple], directory: Path) -> None:
    """This rank's optimizer chunks (``EngineState.optimizer_shard``) ->
    ``<directory>/shard-<rank+1>-model-00001-of-00001.safetensors``, streamed from the
    optimizer's own tensors, with the chunks' global offsets in the header (DCP's sharding
    record, which ``HuggingFaceStorageReader`` reads: any world size loads it back). A rank with
    nothing to write writes no file."""
    if not chunks:
        return
    directory.mkdir(parents=True, exist_ok=True)
    specs = safetensors_order((k, v.dtype, v.shape) for k, (v, _) in chunks.items())
    sharding = {k: {"saved_offsets": offsets} for k, (_, offsets) in chunks.items()}
    metadata = {"DCP_SHARDING_INFO": json.dumps(sharding), "DCP_VERSION": "1.0", "format": "pt"}
    name = f"shard-{engine.world.rank + 1:05d}-model-00001-of-00001.safetensors"
    write_safetensors(
        directory / name,
        specs,
        ((k, chunks[k][0]) for k, _, _ in specs),
        metadata=metadata,
    )


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

    ``engines``: name -> a trainable engine's ``otbrl.engine.state.EngineState``; ``"policy"``
    is stored as the step directory's HF model, any other (``"critic"``) in a subfolder of that
    name; their optimizer shards go under ``state/<name>/``. ``trainer_state`` may nest
    dicts, lists, tuples, JSON scalars, tensors and NumPy arrays; it comes back from
    ``load_checkpoint`` with the same types. ``keep_last=N`` deletes the oldest complete
    checkpoints beyond the newest N afterwards. Temp directories left by a killed save are
    removed. Returns the final path.
    """
    _check_save_args(step, engines, keep_last, trainer_state)
    world = engines["policy"].world
    root = Path(ckpt_root)
    final, tmp = root / f"step_{step}", root / f"{_TMP_PREFIX}{step}"
    state, optimizers = _gather_state(engines, trainer_state)
    tensors: dict[str, torch.Tensor] = {}
    # Encode first: a bad trainer_state fails before anything touches the disk.
    state_json = json.dumps(encode_state(state, tensors, "trainer_state"))
    if world.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"{_TMP_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        (tmp / STATE_DIR).mkdir(parents=True)
    world.barrier()
    try:
        for name, engine in engines.items():
            _write_hf_model(engine, tmp if name == "policy" else tmp / name, world.is_main)
            if name in optimizers:
                _write_optimizer_shard(engine, optimizers[name], tmp / STATE_DIR / name)
        world.barrier()
        if world.is_main:
            _write_run_files(tmp, tokenizer, state_json, tensors, config)
            _publish(tmp, final, root, step=step, world_size=world.size, keep_last=keep_last)
    except BaseException:
        if world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    world.barrier()
    return final


def _check_save_args(step, engines, keep_last, trainer_state) -> None:
    """``save_checkpoint``'s arguments (``ValueError`` / ``TypeError`` naming the argument)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step: expected an int >= 0, got {step!r}")
    if "policy" not in engines:
        raise ValueError(f"engines: expected a 'policy' engine, got {sorted(engines)}")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last: expected None or an int >= 1, got {keep_last!r}")
    if trainer_state is not None and not isinstance(trainer_state, Mapping):
        raise TypeError(f"trainer_state: expected a dict, got {type(trainer_state).__name__}")


def _gather_state(engines: Mapping[str, Any], trainer_state) -> tuple[dict, dict]:
    """``(state, optimizers)``: the state to encode (``{"trainer", "engines": {name: the
    engine's state_dict, with its optimizer's param_groups}}``) and this rank's optimizer
    chunks per engine. Collective."""
    state: dict[str, Any] = {"trainer": dict(trainer_state or {}), "engines": {}}
    optimizers = {}
    for name, engine in engines.items():
        state["engines"][name] = engine.state_dict()
        # collective: every rank gathers its shards' view
        optimizers[name], state["engines"][name]["param_groups"] = engine.optimizer_shard()
    return state, optimizers


def _write_run_files(tmp: Path, tokenizer, state_json: str, tensors: dict, config) -> None:
    """The main rank's files beside the weights: the tokenizer, ``state/trainer_state.json``
    and its tensors (``.safetensors``), ``config.yaml``; then the umask's permissions."""
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    (tmp / STATE_DIR / "trainer_state.json").write_text(state_json)
    specs = safetensors_order((k, v.dtype, v.shape) for k, v in tensors.items())
    write_safetensors(
        tmp / STATE_DIR / "trainer_state.safetensors",
        specs,
        ((k, tensors[k]) for k, _, _ in specs),
    )
    if config is not None:
        import yaml  # a dependency of omegaconf

        (tmp / "config.yaml").write_text(yaml.safe_dump(to_plain_dict(config), sort_keys=False))
    apply_umask(tmp)  # safetensors writes 0600 files


def _publish(tmp: Path, final: Path, root: Path, *, step, world_size, keep_last) -> None:
    """Seal ``tmp`` (the marker with every file's size and hash, all fsynced) and rename it to
    ``final``; then drop the checkpoints older than the newest ``keep_last``. Main rank only."""
    meta = {"format": FORMAT_VERSION, "step": step, "world_size": world_size}
    # hashed after everything else is written, by the rank that publishes: the
    # manifest covers every rank's shards
    meta["files"] = file_manifest(tmp, exclude={MARKER})
    (tmp / MARKER).write_text(json.dumps(meta, indent=1) + "\n")
    fsync_tree(tmp)
    if final.exists():  # saving the same step again (e.g. after a resume): swap it out
        _discard(final, root)
    os.replace(tmp, final)
    fsync_dir(root)
    for old in list_checkpoints(root)[: -keep_last or None] if keep_last else []:
        _discard(old, root)


def _discard(ckpt: Path, root: Path) -> None:
    # Rename first: a kill during the slow delete must not leave a torn step_<k> that still
    # has its marker. The temp name is swept by the next save.
    grave = make_temp_dir(root, f"{_TMP_PREFIX}{ckpt.name}-old-")
    os.replace(ckpt, grave / ckpt.name)
    shutil.rmtree(grave, ignore_errors=True)


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found)


def list_checkpoints(ckpt_root: str | Path) -> list[Path]:
    """Complete ``step_<k>`` directories (with their marker) under ``ckpt_root``, oldest step
    first ([] if none). Cheap: nothing is verified (``verify_checkpoint`` does that)."""
    return [path for _, path in _step_dirs(Path(ckpt_root)) if (path / MARKER).is_file()]


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None; temp and partial dirs ignored."""
    checkpoints = list_checkpoints(ckpt_root)
    return checkpoints[-1] if checkpoints else None


def latest_verified_checkpoint(ckpt_root: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest checkpoint whose files all match its manifest or None, [(newer checkpoint
    directory, why it was passed over), ...]). Directories without a marker (an interrupted
    copy) are reported too; temp directories of a killed save are not checkpoints."""
    skipped: list[tuple[Path, str]] = []
    for _, path in reversed(_step_dirs(Path(ckpt_root))):
        try:
            verify_checkpoint(path)
        except ValueError as err:
            skipped.append((path, str(err)))
            continue
        return path, skipped
    return None, skipped


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint ``path`` names: a ``step_<k>`` directory itself, or — for a run directory
    (``<output_dir>``) or its ``checkpoints/`` folder — the newest checkpoint that verifies.

    Raises ``ValueError`` naming ``path`` when it is none of these or holds no verified
    checkpoint (listing the newer ones passed over and why).
    """
    path = Path(path)
    if (path / MARKER).is_file():
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not _step_dirs(root):
        raise ValueError(
            f"path: {path} is neither a checkpoint (step_<k> with {MARKER}) nor a run "
            "directory with checkpoints"
        )
    found, skipped = latest_verified_checkpoint(root)
    if found is None:
        why = "; ".join(f"{p.name}: {err}" for p, err in skipped)
        raise ValueError(f"path: no checkpoint under {root} verifies ({why})")
    return found


def checkpoint_step(path: str | Path) -> int:
    """The step a complete checkpoint directory was saved at."""
    return int(read_marker(path)["step"])


def read_marker(path: str | Path) -> dict:
    """The ``checkpoint.json`` of a complete checkpoint directory (format, step, world size,
    ``files``: the manifest), its format checked; nothing is verified."""
    ckpt = Path(path)
    if not (ckpt / MARKER).is_file():
        raise ValueError(
            f"path: expected a complete checkpoint directory (step_<k> with {MARKER}), "
            f"got {ckpt} (a run directory or its checkpoints/ folder stands for its newest "
            "verified checkpoint)"
        )
    try:
        meta = json.loads((ckpt / MARKER).read_text())
    except (ValueError, UnicodeDecodeError):
        raise IntegrityError(f"{ckpt}: file '{MARKER}' is not valid JSON (corrupted)") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise ValueError(
            f"path: {ckpt} has checkpoint format {found}, this otbrl reads format {FORMAT_VERSION}"
        )
    return meta


def verify_checkpoint(path: str | Path) -> int:
    """Check a checkpoint directory against its ``checkpoint.json`` (every file present, with
    its size and SHA-256, and nothing else); returns its step. Raises ``ValueError`` (an
    ``IntegrityError`` for damaged files) naming the directory and the file."""
    ckpt = Path(path)
    meta = read_marker(ckpt)
    verify_manifest(ckpt, meta.get("files") or {}, exclude={MARKER})
    return int(meta["step"])


def _load_weights(engine, directory: Path) -> None:
    """Full HF tensors -> the engine's model, in its own layout (sharded or not)."""
    has_adapter = (directory / ADAPTER_DIR / ADAPTER_CONFIG).is_file()
    if (engine.lora is not None) != has_adapter:
        held = "a LoRA adapter" if has_adapter else "full weights"
        wants = "LoRA (model.lora.rank > 0)" if not has_adapter else "full fine-tuning"
        raise ValueError(f"checkpoint: {directory} holds {held}, the run trains {wants}")
    if has_adapter:
        adapter = directory / ADAPTER_DIR
        engine.load_adapter(load_file(adapter / ADAPTER_WEIGHTS), source=f"checkpoint: {adapter}")
        return
    if not (directory / "model.safetensors").is_file():
        raise ValueError(f"checkpoint: {directory} holds no model.safetensors")
    # A tied alias is loaded through its kept name (otbrl.models.tied); checkpoints written
    # before that rule hold the alias too, and it is the same tensor: ignored.
    aliases = engine.tied_aliases()
    state = engine.weights()
    saved = HuggingFaceStorageReader(str(directory)).read_metadata().state_dict_metadata
    saved = {k: v for k, v in saved.items() if k not in aliases}
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
    engine.load_weights(state)


def _load_optimizer(engine, directory: Path, param_groups: list) -> None:
    """Optimizer shards -> the engine's AdamW, resharded to its layout."""
    keys = HuggingFaceStorageReader(str(directory)).read_metadata().state_dict_metadata
    flat = engine.optimizer_template(keys, source="checkpoint")
    _dcp(dcp.load, flat, engine, storage_reader=HuggingFaceStorageReader(str(directory)))
    engine.load_optimizer(flat, param_groups)


def load_checkpoint(
    path: str | Path, *, engines: Mapping[str, Any], verify: bool = True
) -> dict[str, Any]:
    """Restore the engines (weights, optimizer, scheduler, generator) in place from a complete
    checkpoint, whatever world size or engine wrote it; returns the trainer_state.

    Collective. ``verify=True`` checks every file against the manifest first (pass False only
    when ``verify_checkpoint`` just did). Raises ``ValueError`` for an incomplete or damaged
    directory (naming the file) or one that does not match the engines (another model, an
    engine the checkpoint does not hold).
    """
    ckpt = Path(path)
    if verify:
        verify_checkpoint(ckpt)
    else:
        read_marker(ckpt)
    state_dir = ckpt / STATE_DIR
    tensors = load_file(state_dir / "trainer_state.safetensors")
    state = decode_state(json.loads((state_dir / "trainer_state.json").read_text()), tensors)
    for name, engine in engines.items():
        if name not in state["engines"]:
            raise ValueError(f"checkpoint: {ckpt} holds no {name!r} engine")
        _load_weights(engine, ckpt if name == "policy" else ckpt / name)
        saved = dict(state["engines"][name])
        _load_optimizer(engine, state_dir / name, saved.pop("param_groups"))
        engine.load_state_dict(saved)
    return state["trainer"]
