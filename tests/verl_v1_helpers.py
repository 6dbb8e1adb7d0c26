"""verl's V1 trainer config and the upstream patch applied to a copy of verl's V1 trainer, for
tests/test_integrations_verl_v1.py (``.venv-verl``)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
PATCH = ROOT / "integrations" / "verl" / "verl-0.9.1-v1-sum-pi-squared.patch"
TRAINER_BASE = "verl/trainer/ppo/v1/trainer_base.py"


def verl_config(mode: str, estimator: str, *, temperature: float, n: int, rollout_is=None):
    """verl's own full default config (``_generated_ppo_trainer.yaml``, what ``main_ppo``
    composes) with the V1 mode, the estimator and the rollout settings the tests use."""
    import verl

    path = Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"
    config = OmegaConf.load(path)
    config.trainer.v1.trainer_mode = mode
    config.algorithm.adv_estimator = estimator
    config.algorithm.rollout_correction.rollout_is = rollout_is
    config.actor_rollout_ref.rollout.temperature = temperature
    config.actor_rollout_ref.rollout.n = n
    return config


def apply_patch(root: Path) -> Path:
    """A copy of verl's installed ``trainer_base.py`` under ``root`` with the patch applied by
    ``git apply`` (which refuses fuzz and offsets: the patch must apply cleanly)."""
    import verl

    site = Path(verl.__file__).parent.parent
    target = root / TRAINER_BASE
    target.parent.mkdir(parents=True)
    shutil.copyfile(site / TRAINER_BASE, target)
    # outside any repository, so git applies to these files whatever folder holds them
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(root.parent)}
    for args in (["--check"], []):
        subprocess.run(
            ["git", "apply", *args, str(PATCH)], cwd=root, env=env, check=True, timeout=60
        )
    return target


def load_patched_trainer_base(root: Path):
    """The patched copy imported as a module of its own name: its ``verl.*`` imports are the
    installed verl's, and the plug-in's import hook (for verl's module name) leaves it alone."""
    path = apply_patch(root)
    spec = importlib.util.spec_from_file_location("verl_v1_trainer_base_patched", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
