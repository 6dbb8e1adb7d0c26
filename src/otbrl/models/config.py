"""The model's own settings: LoRA adapters (``model.lora.*``) and the dtype names a model may be
loaded in. No torch: the CLI's schema composes ``LoraConfig`` and starts without it."""

from __future__ import annotations

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
