"""LoRA adapters through ``peft``, injected into a plain HF model in place.

``peft.inject_adapter_in_model`` replaces each targeted ``nn.Linear`` by a LoRA layer that holds
the frozen original as ``<module>.base_layer`` and the trained ``lora_A`` [r, in] / ``lora_B``
[out, r]; the model stays a plain causal LM (``model.model.layers``, ``lm_head``), so every
layout, FSDP2 and the fused head see the same module tree as without LoRA.

- The reference policy is the same model under ``adapters_disabled``: no second copy of the
  weights.
- ``merged_tensors`` turns the model's state dict into plain HF names with
  W = W₀ + (alpha / r) · B·A, one module at a time (vLLM's ``reload_weights``, ``otbrl export``).
- ``adapter_tensors`` / ``save_adapter`` / ``load_adapter`` speak PEFT's on-disk format
  (``adapter_config.json`` + ``adapter_model.safetensors`` with ``base_model.model.`` names), so a
  saved adapter loads with ``peft.PeftModel.from_pretrained``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from otbrl.errors import ConfigError
from otbrl.models.config import ADAPTER_CONFIG, LoraConfig
from otbrl.settings import check_settings

ADAPTER_WEIGHTS = "adapter_model.safetensors"
_ADAPTER = "default"  # peft's adapter name; one adapter per model here
_PEFT_PREFIX = "base_model.model."  # how PeftModel.save_pretrained names the tensors


def linear_module_names(model: nn.Module) -> list[str]:
    """Sorted leaf names of the decoder's ``nn.Linear`` modules (``q_proj``, ``up_proj``...),
    the output embedding excluded: what ``target_modules`` may name."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and module is not head
        }
    )


def add_lora(
    model: nn.Module,
    settings: LoraConfig,
    *,
    adapter_dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> nn.Module:
    """Inject LoRA adapters into ``model`` in place and return it; only they require grad.

    Args:
        settings: ``model.lora``: the adapter's ``rank`` r (> 0), ``alpha`` (the output is
            scaled by alpha / r), input ``dropout``, ``target_modules`` (``"all-linear"`` or
            leaf module names, see ``linear_module_names``) and ``adapter_path``, a PEFT
            adapter directory to start from, whose own rank, alpha, dropout and targets are
            used (the settings' are then ignored). ``sync`` is the rollout's concern.
        adapter_dtype: dtype of the adapter weights (float32: the trained master copy, also
            over a bf16 frozen base).
        seed: seeds the adapters' initialisation (the global RNG is left untouched), so every
            rank of a sharded run starts from the same adapters.

    Raises ``ConfigError`` naming the key when a setting is out of its declared range or the
    rank is 0, ``ValueError`` naming ``target_modules`` (with the model's linear module names)
    when it matches nothing, or ``adapter_path`` when its tensors do not fit the model.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    check_settings(settings, "model.lora.")
    if settings.rank == 0:
        raise ConfigError("'model.lora.rank': expected > 0 for adapters, got 0", "model.lora.rank")
    rank, alpha, dropout = settings.rank, settings.alpha, settings.dropout
    target_modules, adapter_path = settings.target_modules, settings.adapter_path
    if adapter_path is not None:
        saved = json.loads((Path(adapter_path) / ADAPTER_CONFIG).read_text())
        rank, alpha = int(saved["r"]), float(saved["lora_alpha"])
        target_modules = saved["target_modules"]
        dropout = float(saved.get("lora_dropout", dropout))
    targets = target_modules if isinstance(target_modules, str) else sorted(target_modules)
    config = PeftLoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            inject_adapter_in_model(config, model, adapter_name=_ADAPTER)
    except ValueError as err:
        if "not found in the base model" not in str(err) and "No modules were targeted" not in str(
            err
        ):
            raise
        raise ValueError(
            f"target_modules: {target_modules!r} names no module of this model; its linear "
            f"layers are {linear_module_names(model)}"
        ) from None
    for name, param in model.named_parameters():
        if ".lora_" in name:
            param.data = param.data.to(adapter_dtype)
    model._otbrl_lora = {"rank": rank, "alpha": alpha, "dropout": dropout, "targets": targets}
    if adapter_path is not None:
        load_adapter(model, adapter_path)
    return model


def lora_settings(model: nn.Module) -> dict | None:
    """``{"rank", "alpha", "dropout", "targets"}`` of a model ``add_lora`` changed, else None."""
    return getattr(model, "_otbrl_lora", None)


def _lora_layers(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Run ``model`` as its base model (every LoRA branch skipped) inside the block."""
    layers = _lora_layers(model)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def unload_lora(model: nn.Module) -> nn.Module:
    """Merge every adapter into its base layer and put the plain ``nn.Linear`` back, in place:
    the LoRA model as the plain HF model it computes (an inference copy). Returns ``model``."""
    modules = dict(model.named_modules())
    layers = {id(m) for m in _lora_layers(model)}
    for name, module in list(modules.items()):
        if id(module) in layers:
            module.merge()
            parent_name, _, child = name.rpartition(".")
            setattr(modules[parent_name] if parent_name else model, child, module.get_base_layer())
    if hasattr(model, "_otbrl_lora"):
        del model._otbrl_lora
    return model


def merged_tensors(
    named_tensors: Iterable[tuple[str, Tensor]], *, scaling: float
) -> Iterator[tuple[str, Tensor]]:
    """A LoRA model's (name, tensor) stream -> the plain HF model's, adapters merged.

    ``<m>.base_layer.weight`` [out, in] with ``<m>.lora_A.default.weight`` [r, in] and
    ``<m>.lora_B.default.weight`` [out, r] become ``<m>.weight`` = W₀ + scaling · B·A (computed in
    float32, returned in W₀'s dtype); ``<m>.base_layer.bias`` becomes ``<m>.bias``; other entries
    pass through. Holds at most one module's tensors at a time (a streaming sync).
    """
    pending: dict[str, dict[str, Tensor]] = {}
    for name, value in named_tensors:
        if ".base_layer." in name:
            module, leaf = name.split(".base_layer.")
            if leaf != "weight":
                yield f"{module}.{leaf}", value
                continue
            pending.setdefault(module, {})["w"] = value
        elif f".lora_A.{_ADAPTER}.weight" in name:
            module = name.split(".lora_A.")[0]
            pending.setdefault(module, {})["a"] = value
        elif f".lora_B.{_ADAPTER}.weight" in name:
            module = name.split(".lora_B.")[0]
            pending.setdefault(module, {})["b"] = value
        else:
            yield name, value
            continue
        parts = pending[module]
        if len(parts) == 3:
            del pending[module]
            w = parts["w"]
            delta = parts["b"].float() @ parts["a"].float()
            yield f"{module}.weight", (w.float() + scaling * delta).to(w.dtype)
    if pending:
        raise ValueError(f"named_tensors: incomplete LoRA modules {sorted(pending)[:3]}")


def adapter_tensors(named_tensors: Iterable[tuple[str, Tensor]]) -> dict[str, Tensor]:
    """The adapter entries of a LoRA model's (name, tensor) stream in PEFT's file names
    (``base_model.model.<m>.lora_A.weight``)."""
    out = {}
    for name, value in named_tensors:
        if ".lora_" in name:
            out[_PEFT_PREFIX + name.replace(f".{_ADAPTER}.", ".")] = value.detach().contiguous()
    return out


def model_names(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """PEFT file names (``adapter_tensors``) -> the LoRA model's own parameter names."""
    out = {}
    for name, value in tensors.items():
        plain = name.removeprefix(_PEFT_PREFIX)
        for kind in ("lora_A", "lora_B"):
            plain = plain.replace(f".{kind}.", f".{kind}.{_ADAPTER}.")
        out[plain] = value
    return out


def adapter_config(model: nn.Module, base_model: str = "") -> dict:
    """PEFT's ``adapter_config.json`` content for a model ``add_lora`` changed."""
    from peft import LoraConfig as PeftLoraConfig

    s = lora_settings(model)
    if s is None:
        raise ValueError("model: it has no LoRA adapters (add_lora)")
    targets = s["targets"] if isinstance(s["targets"], str) else sorted(s["targets"])
    config = PeftLoraConfig(
        r=s["rank"],
        lora_alpha=s["alpha"],
        lora_dropout=s["dropout"],
        target_modules=targets,
        base_model_name_or_path=base_model or None,
        task_type="CAUSAL_LM",
    )
    plain = config.to_dict()
    # the resolved module names, so the file loads the same modules with any peft version
    plain["target_modules"] = sorted(
        {
            name.split(".lora_A.")[0].rsplit(".", 1)[-1]
            for name, _ in model.named_parameters()
            if ".lora_A." in name
        }
    )
    return json.loads(json.dumps(plain, default=_json_value))


def _json_value(value):
    return sorted(value) if isinstance(value, set) else str(value)


def save_adapter(tensors: dict[str, Tensor], config: dict, out_dir: str | Path) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (``adapter_tensors``'
    names) into ``out_dir``; returns it."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return out


def load_adapter(model: nn.Module, adapter_dir: str | Path) -> None:
    """Copy a saved adapter's tensors into ``model``'s LoRA parameters (same ranks and modules).

    Raises ``ValueError`` naming ``adapter_path`` when a module is missing on either side or a
    shape differs (an adapter trained on another base model).
    """
    from safetensors import safe_open

    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    params = {
        _PEFT_PREFIX + name.replace(f".{_ADAPTER}.", "."): p
        for name, p in model.named_parameters()
        if ".lora_" in name
    }
    with safe_open(str(path), framework="pt") as f:
        saved = set(f.keys())
        missing, unexpected = sorted(set(params) - saved), sorted(saved - set(params))
        if missing or unexpected:
            raise ValueError(
                f"adapter_path: {adapter_dir} does not fit this model (missing "
                f"{missing[:2]}, unexpected {unexpected[:2]}): trained on another base model?"
            )
        for name, param in params.items():
            value = f.get_tensor(name)
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(
                    f"adapter_path: {adapter_dir} does not fit this model: {name} has shape "
                    f"{tuple(value.shape)}, the model's is {tuple(param.shape)} (trained on "
                    "another base model?)"
                )
            with torch.no_grad():
                param.copy_(value.to(param.dtype))


def check_adapter_fits(model: nn.Module, adapter_dir: str | Path) -> None:
    """``load_adapter``'s checks without loading: for a model on the meta device (the plan's
    check before any weights load). Raises ``ValueError`` naming ``adapter_path``."""
    from safetensors import safe_open

    saved = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())
    modules = dict(model.named_modules())
    with safe_open(str(Path(adapter_dir) / ADAPTER_WEIGHTS), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
            name = key.removeprefix(_PEFT_PREFIX)
            module_name, _, kind = name.rpartition(".lora_")
            module = modules.get(module_name)
            shape = tuple(f.get_slice(key).get_shape())
            if not isinstance(module, nn.Linear):
                raise ValueError(
                    f"adapter_path: {adapter_dir} adapts {module_name}, which this model does "
                    "not have as a linear layer: trained on another base model?"
                )
            want = (
                (int(saved["r"]), module.in_features)
                if kind.startswith("A")
                else (module.out_features, int(saved["r"]))
            )
            if shape != want:
                raise ValueError(
                    f"adapter_path: {adapter_dir} does not fit this model: {key} has shape "
                    f"{shape}, this model needs {want} (trained on another base model?)"
                )
