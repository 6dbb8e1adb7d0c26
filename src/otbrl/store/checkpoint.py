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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from otbrl.models.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_config,
    adapter_tensors,
    add_lora,
    lora_settings,
    model_names,
    save_adapter,
    unload_lora,
)
from otbrl.models.tied import tied_aliases
from otbrl.store.files import apply_umask, fsync_dir, fsync_tree, make_temp_dir
from otbrl.store.integrity import IntegrityError, file_manifest, verify_manifest
from otbrl.store.plain import to_plain_dict
from otbrl.store.state_codec import capture_rng_state, decode_state, encode_state, restore_rng_state
from otbrl.store.tensor_file import safetensors_order, write_safetensors

__all__ = [
    "IntegrityError",
    "capture_rng_state",
    "checkpoint_step",
    "export_checkpoint",
    "latest_checkpoint",
    "latest_verified_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "resolve_checkpoint",
    "restore_rng_state",
    "save_checkpoint",
    "verify_checkpoint",
]

FORMAT_VERSION = 3  # 3: checkpoint.json lists every file with its size and SHA-256
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-step_"
_MARKER = "checkpoint.json"
STATE_DIR = "state"
# What `otbrl export` leaves out of a step directory: everything but the policy's HF files.
_TRAINING_ENTRIES = {STATE_DIR, "critic", "config.yaml", _MARKER}
# A LoRA policy is stored as its adapter alone, in PEFT's format (the frozen base is model.path)
ADAPTER_DIR = "adapter"


def _write_hf_model(engine, out: Path, is_main: bool) -> None:
    """config.json (+ generation_config.json) and model.safetensors, streamed: one full tensor
    at a time is gathered (collective under a mesh: every rank drains the iterator), written by
    the main rank and dropped — no rank ever holds a second copy of the model."""
    model = engine.model
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(out)
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(out)
    if lora_settings(model) is not None:
        _write_adapter(engine, out / ADAPTER_DIR, is_main)
        return
    # a DTensor reports its global shape and dtype: the header needs no gather. Tied aliases
    # are left out (otbrl.models.tied), as save_pretrained does: HF re-ties them on load.
    aliases = tied_aliases(model)
    specs = safetensors_order(
        (k, v.dtype, v.shape) for k, v in model.state_dict().items() if k not in aliases
    )
    tensors = engine.state_tensors([name for name, _, _ in specs])
    if is_main:
        write_safetensors(out / "model.safetensors", specs, tensors, metadata={"format": "pt"})
    else:
        for _ in tensors:
            pass


def _write_adapter(engine, out: Path, is_main: bool) -> None:
    """A LoRA model's adapter in PEFT's format (the frozen base is not written: it is the
    model the run started from, ``adapter_config.json``'s ``base_model_name_or_path``)."""
    names = [k for k in engine.model.state_dict() if ".lora_" in k]
    tensors = adapter_tensors(engine.state_tensors(names))  # collective; the adapters only
    if is_main:
        base = str(getattr(engine.model.config, "_name_or_path", "") or "")
        save_adapter(tensors, adapter_config(engine.model, base), out)


def _load_adapter_weights(engine, directory: Path) -> None:
    """A saved adapter -> the engine's LoRA parameters, in its own layout (sharded or not)."""
    saved = load_file(directory / ADAPTER_WEIGHTS)
    params = {k for k in engine.model.state_dict() if ".lora_" in k}
    named = model_names(saved)
    missing, unexpected = sorted(params - set(named)), sorted(set(named) - params)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint: {directory} does not match the model's adapters (missing "
            f"{missing[:3]}, unexpected {unexpected[:3]})"
        )
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(engine.model, named, options=options)


def _optimizer_tensors(engine) -> tuple[dict[str, torch.Tensor], list]:
    """The optimizer state flattened to ``state.<param>.<key>`` tensors (sharded like the
    parameters, references to the optimizer's own tensors) and its param groups (plain
    values)."""
    osd = get_optimizer_state_dict(engine.model, engine.optimizer)
    flat = {f"state.{p}.{k}": v for p, d in osd["state"].items() for k, v in d.items()}
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"optimizer state {key}: expected a tensor, got {type(value).__name__}")
    return flat, osd["param_groups"]


def _local_chunks(
    flat: Mapping[str, torch.Tensor], is_main: bool
) -> dict[str, tuple[torch.Tensor, list[int]]]:
    """key -> (this rank's chunk, its offset in the global tensor) for the chunks this rank
    writes: a sharded tensor's local shard, written by one rank per replica group (coordinate 0
    on every mesh dimension it is not sharded over); a plain (replicated) tensor by the main
    rank alone."""
    chunks = {}
    for key, value in flat.items():
        if isinstance(value, DTensor):
            coordinate = value.device_mesh.get_coordinate()
            if coordinate is None:  # this rank is not in the tensor's mesh
                continue
            if any(
                not p.is_shard() and c != 0
                for p, c in zip(value.placements, coordinate, strict=True)
            ):
                continue
            local = value.to_local()
            if local.numel() == 0 and value.numel() != 0:
                continue  # an uneven shard left this rank empty
            _, offsets = compute_local_shape_and_global_offset(
                value.shape, value.device_mesh, value.placements
            )
            chunks[key] = (local, [int(o) for o in offsets])
        elif is_main:
            chunks[key] = (value, [0] * value.dim())
    return chunks


def _write_optimizer_shard(engine, flat: Mapping[str, torch.Tensor], directory: Path) -> None:
    """This rank's optimizer chunks -> ``<directory>/shard-<rank+1>-model-00001-of-00001
    .safetensors``, streamed from the optimizer's own tensors, with the chunks' global offsets
    in the header (DCP's sharding record, which ``HuggingFaceStorageReader`` reads: any world
    size loads it back). A rank with nothing to write writes no file."""
    world = engine.world
    chunks = _local_chunks(flat, world.is_main)
    if not chunks:
        return
    directory.mkdir(parents=True, exist_ok=True)
    specs = safetensors_order((k, v.dtype, v.shape) for k, (v, _) in chunks.items())
    sharding = {k: {"saved_offsets": offsets} for k, (_, offsets) in chunks.items()}
    metadata = {"DCP_SHARDING_INFO": json.dumps(sharding), "DCP_VERSION": "1.0", "format": "pt"}
    name = f"shard-{world.rank + 1:05d}-model-00001-of-00001.safetensors"
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

                (tmp / "config.yaml").write_text(
                    yaml.safe_dump(to_plain_dict(config), sort_keys=False)
                )
            apply_umask(tmp)  # safetensors writes 0600 files
            meta = {"format": FORMAT_VERSION, "step": step, "world_size": world.size}
            # hashed after everything else is written, by the rank that publishes: the
            # manifest covers every rank's shards
            meta["files"] = file_manifest(tmp, exclude={_MARKER})
            (tmp / _MARKER).write_text(json.dumps(meta, indent=1) + "\n")
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
    return [path for _, path in _step_dirs(Path(ckpt_root)) if (path / _MARKER).is_file()]


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
    if (path / _MARKER).is_file():
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not _step_dirs(root):
        raise ValueError(
            f"path: {path} is neither a checkpoint (step_<k> with {_MARKER}) nor a run "
            "directory with checkpoints"
        )
    found, skipped = latest_verified_checkpoint(root)
    if found is None:
        why = "; ".join(f"{p.name}: {err}" for p, err in skipped)
        raise ValueError(f"path: no checkpoint under {root} verifies ({why})")
    return found


def checkpoint_step(path: str | Path) -> int:
    """The step a complete checkpoint directory was saved at."""
    return int(_read_marker(path)["step"])


def _read_marker(path: str | Path) -> dict:
    ckpt = Path(path)
    if not (ckpt / _MARKER).is_file():
        raise ValueError(
            f"path: expected a complete checkpoint directory (step_<k> with {_MARKER}), "
            f"got {ckpt} (a run directory or its checkpoints/ folder stands for its newest "
            "verified checkpoint)"
        )
    try:
        meta = json.loads((ckpt / _MARKER).read_text())
    except (ValueError, UnicodeDecodeError):
        raise IntegrityError(f"{ckpt}: file '{_MARKER}' is not valid JSON (corrupted)") from None
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
    meta = _read_marker(ckpt)
    verify_manifest(ckpt, meta.get("files") or {}, exclude={_MARKER})
    return int(meta["step"])


def _load_weights(engine, directory: Path) -> None:
    """Full HF tensors -> the engine's model, in its own layout (sharded or not)."""
    has_adapter = (directory / ADAPTER_DIR / ADAPTER_CONFIG).is_file()
    if (lora_settings(engine.model) is not None) != has_adapter:
        held = "a LoRA adapter" if has_adapter else "full weights"
        wants = "LoRA (model.lora.rank > 0)" if not has_adapter else "full fine-tuning"
        raise ValueError(f"checkpoint: {directory} holds {held}, the run trains {wants}")
    if has_adapter:
        _load_adapter_weights(engine, directory / ADAPTER_DIR)
        return
    if not (directory / "model.safetensors").is_file():
        raise ValueError(f"checkpoint: {directory} holds no model.safetensors")
    # A tied alias is loaded through its kept name (otbrl.models.tied); checkpoints written
    # before that rule hold the alias too, and it is the same tensor: ignored.
    aliases = tied_aliases(engine.model)
    state = {k: v for k, v in get_model_state_dict(engine.model).items() if k not in aliases}
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
    set_model_state_dict(engine.model, state, options=StateDictOptions(strict=not aliases))


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
        _read_marker(ckpt)
    state_dir = ckpt / STATE_DIR
    tensors = load_file(state_dir / "trainer_state.safetensors")
    state = decode_state(json.loads((state_dir / "trainer_state.json").read_text()), tensors)
    for name, engine in engines.items():
        if name not in state["engines"]:
            raise ValueError(f"checkpoint: {ckpt} holds no {name!r} engine")
        _load_weights(engine, ckpt if name == "policy" else ckpt / name)
        saved = dict(state["engines"][name])
        if engine.optimizer is not None:
            _load_optimizer(engine, state_dir / name, saved.pop("param_groups"))
        engine.load_state_dict(saved)
    return state["trainer"]


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
        files = _read_marker(ckpt)["files"]
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
    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    add_lora(model, rank=1, alpha=1.0, adapter_path=adapter_dir, adapter_dtype=torch.float32)
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
