"""A checkpoint's trainer state and RNG streams as JSON + safetensors: values that load back
with the same types and never need unpickling (``save_checkpoint`` / ``load_checkpoint``)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

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


def encode_state(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
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
        return {
            "__tuple__": [encode_state(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
        }
    if isinstance(value, list):
        return [encode_state(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value) and not any(k.startswith("__") for k in value):
            return {k: encode_state(v, tensors, f"{where}[{k!r}]") for k, v in value.items()}
        return {
            "__items__": [
                [encode_state(k, tensors, where), encode_state(v, tensors, f"{where}[{k!r}]")]
                for k, v in value.items()
            ]
        }
    raise TypeError(
        f"{where}: cannot store a {type(value).__name__}; expected JSON values, tuples, "
        "dicts, tensors or numpy arrays"
    )


def decode_state(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [decode_state(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return tensors[value["__tensor__"]]
    if "__ndarray__" in value:
        return tensors[value["__ndarray__"]].numpy().astype(np.dtype(value["dtype"]))
    if "__tuple__" in value:
        return tuple(decode_state(v, tensors) for v in value["__tuple__"])
    if "__items__" in value:
        return {decode_state(k, tensors): decode_state(v, tensors) for k, v in value["__items__"]}
    return {k: decode_state(v, tensors) for k, v in value.items()}
