"""The model's own settings: LoRA adapters (``model.lora.*``) and the dtype names a model may be
loaded in. No torch: the CLI's schema composes ``LoraConfig`` and starts without it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otbrl.errors import ConfigError
from otbrl.settings import refuse_unset, setting

# model.lora.sync: how vLLM gets the trained adapters (merged weights, or the adapter served)
LORA_SYNCS = ("merged", "adapter")
# the dtypes a model or a rollout engine may be loaded in (``otbrl.models.hf.DTYPES``)
DTYPE_NAMES = ("float32", "bfloat16", "float16")
ADAPTER_CONFIG = "adapter_config.json"


@dataclass
class LoraConfig:
    """LoRA adapters through ``peft`` (``model.lora.rank`` > 0): only they are trained, the
    reference policy is the same model with its adapters disabled."""

    rank: int = setting(0, ge=0, resume="fixed")  # adapter rank r; 0 = off (full fine-tuning)
    # the adapter's output is scaled by alpha / rank
    alpha: float = setting(32.0, gt=0, resume="fixed")
    # dropout on the adapter's input while training
    dropout: float = setting(0.0, ge=0, lt=1, resume="fixed")
    # "all-linear" (every linear layer of the decoder blocks, not the lm_head) or a list of
    # module names, e.g. [q_proj, v_proj]
    target_modules: Any = setting("all-linear", resume="fixed")
    # a saved PEFT adapter directory to start from (adapter_config.json); None: fresh adapters
    adapter_path: str | None = setting(None, resume="fixed")
    # how vLLM gets the trained adapters: "merged" (W0 + B·A pushed as plain weights through
    # reload_weights) | "adapter" (the adapter alone, served by vLLM's LoRA support)
    sync: str = setting("merged", choices=LORA_SYNCS, resume="fixed")

    def check(self, at: str) -> None:
        """Its keys only with ``rank`` > 0, the target modules named, the adapter saved."""
        if self.rank == 0:
            others = [key for key in vars(self) if key != "rank"]
            refuse_unset(self, at, f"'{at}rank' is 0 (LoRA off)", f"set {at}rank (e.g. 16)", others)
            return
        target = self.target_modules
        names = [target] if isinstance(target, str) else list(target or [])
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ConfigError(
                f"'{at}target_modules' must be \"all-linear\" or a list of module names, "
                f"got {target!r}",
                f"{at}target_modules",
            )
        adapter = self.adapter_path
        if adapter is not None and not (Path(adapter) / ADAPTER_CONFIG).is_file():
            raise ConfigError(
                f"'{at}adapter_path' {adapter!r} holds no {ADAPTER_CONFIG} "
                "(expected a directory saved by PEFT or `otbrl export --adapter-only`)",
                f"{at}adapter_path",
            )

    def follow_adapter(self, at: str) -> None:
        """With a saved adapter (``adapter_path``, LoRA on): the keys it fixes (rank, alpha,
        dropout, target modules) take the adapter's own values where they are left at their
        defaults, so the run's configuration says what it trains; a key set to another value
        than the adapter's is a ``ConfigError`` naming it (the adapter's would be trained)."""
        if not self.rank or self.adapter_path is None:
            return
        file = Path(self.adapter_path) / ADAPTER_CONFIG
        if not file.is_file():
            return  # check() names the key
        saved = json.loads(file.read_text())
        own = {
            "rank": int(saved["r"]),
            "alpha": float(saved["lora_alpha"]),
            "dropout": float(saved.get("lora_dropout") or 0.0),
            "target_modules": saved["target_modules"],
        }
        defaults = LoraConfig()
        for key, value in own.items():
            current = getattr(self, key)
            if _same(current, value):
                continue
            if key != "rank" and _same(current, getattr(defaults, key)):
                setattr(self, key, value)
                continue
            raise ConfigError(
                f"'{at}{key}' is {current!r} but the adapter in {self.adapter_path!r} was "
                f"trained with {value!r}, which is what would train: set {at}{key}={value!r} "
                f"or leave {at}adapter_path out",
                f"{at}{key}",
            )


def _same(a: Any, b: Any) -> bool:
    """Two LoRA settings' values are the same (target module lists as sets)."""
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return sorted(a) == sorted(b)
    return a == b
