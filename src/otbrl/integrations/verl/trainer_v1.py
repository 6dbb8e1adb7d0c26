"""Σπ² through verl's V1 trainer (``trainer.use_v1=True``, verl's default since verl #6823).

verl 0.9.1's V1 trainer (``verl/trainer/ppo/v1/trainer_base.py``) never asks the actor for Σπ²
and its advantage step never fetches ``sum_pi_squared``, so OTB fails there in verl's
``compute_advantage``. The three V1 modes (sync, colocate-async, separate-async) share the
base class's step functions (separate-async wraps the old-log-prob step to swap in π_old and
calls the base one), so the patch is on ``PPOTrainer`` and reaches all three:

- ``__init__``: :func:`check_v1_config` first, so a path that cannot carry Σπ² is one
  ``ConfigError`` naming the key before any worker starts;
- ``_compute_old_log_prob``: ``calculate_sum_pi_squared=True`` in the batch's ``extra_info``
  (it reaches the engine as a micro-batch flag, as the legacy trainer's does); afterwards the
  actor's Σπ² (nested over prompt + response, as the engine returns it) is rewritten in the
  TransferQueue to response tokens, aligned like ``old_log_probs`` (``response_from_nested``);
- ``_compute_advantage``: Σπ² is read from the TransferQueue for the batch's keys and padded;
  the module's ``compute_advantage_for_multi_trajectories`` puts it into the ``DataProto``
  that verl's ``compute_advantage`` hands to the estimator (the field list of verl's advantage
  step is a local variable: this is the one seam between the fetch and the estimator).

When to ask is otbrl's rule, not a list of names: the estimator registered in otbrl under
verl's ``algorithm.adv_estimator`` needs ``sum_pi_squared`` (``Estimator.needs_for``), or the
user asked for it (``actor.calculate_sum_pi_squared=True``, as with the legacy trainer).

The module is patched when it is imported (:func:`install_v1_trainer_patch` adds an import
hook), not when the plug-in loads: ``import verl`` loads the plug-in in every Ray worker, and
the V1 trainer module imports TransferQueue and most of verl's trainer (~1 s) that only the
trainer's process needs.
"""

from __future__ import annotations

import contextvars
import importlib.abc
import logging
import sys

from otbrl.algos.advantages import ESTIMATORS
from otbrl.errors import ConfigError
from otbrl.integrations.verl.fused_forward import BACKEND

logger = logging.getLogger("otbrl.integrations.verl")

MODULE = "verl.trainer.ppo.v1.trainer_base"
STAT = "sum_pi_squared"
# verl 0.9.1 engines whose prepare_model_outputs has no Σπ² (the FSDP, VeOmni and Megatron
# engines compute it from the logits)
NO_SUM_PI_SQUARED = ("torchtitan", "automodel")
# (batch keys, [B, Lr] Σπ²) of the advantage step in progress, for the seam function
_CARRIED: contextvars.ContextVar[tuple[list, object] | None] = contextvars.ContextVar(
    "otbrl_verl_v1_sum_pi_squared", default=None
)


def _estimator_name(config) -> str:
    name = config.algorithm.adv_estimator
    return str(getattr(name, "value", name))  # verl's AdvantageEstimator is a str Enum


def estimator_needs_sum_pi_squared(config) -> bool:
    """Whether otbrl's registration of verl's ``algorithm.adv_estimator`` needs Σπ² (verl hands
    its OTB functions no options, so the needs are those of the defaults); False for an
    estimator otbrl does not register (verl's ``remax``, ``gdpo``, ...)."""
    estimator = ESTIMATORS.get(_estimator_name(config))
    return estimator is not None and STAT in estimator.needs_for()


def sum_pi_squared_wanted(config) -> bool:
    """Whether the V1 trainer asks the actor for Σπ²: the estimator needs it, or the user asked
    (``actor_rollout_ref.actor.calculate_sum_pi_squared=True``)."""
    asked = bool(config.actor_rollout_ref.actor.get("calculate_sum_pi_squared", False))
    return asked or estimator_needs_sum_pi_squared(config)


def check_v1_config(config) -> None:
    """Raise one ``ConfigError`` naming the key when Σπ² is wanted and this V1 path cannot
    carry it: bypass mode (no actor forward for old log-probs), an engine without Σπ², or fused
    kernels without a fused forward that returns it."""
    if not sum_pi_squared_wanted(config):
        return
    if estimator_needs_sum_pi_squared(config):
        why = f"algorithm.adv_estimator={_estimator_name(config)} needs Σπ² from the actor"
    else:
        why = "actor_rollout_ref.actor.calculate_sum_pi_squared=True asks the actor for Σπ²"
    correction = config.algorithm.get("rollout_correction", None) or {}
    if correction.get("bypass_mode", False):
        key = "algorithm.rollout_correction.bypass_mode"
        raise ConfigError(
            f"{why}, computed in the old-log-prob forward that {key}=True skips: set {key}=False",
            key=key,
        )
    actor, model = config.actor_rollout_ref.actor, config.actor_rollout_ref.model
    strategy = actor.get("strategy", "fsdp")
    if strategy in NO_SUM_PI_SQUARED:
        key = "actor_rollout_ref.actor.strategy"
        raise ConfigError(
            f"{why}; verl's {strategy} engine does not compute it: set {key}=fsdp2 "
            "(or fsdp, megatron, veomni)",
            key=key,
        )
    if not model.get("use_fused_kernels", False):
        return
    backend = (model.get("fused_kernel_options", None) or {}).get("impl_backend", None)
    if strategy == "megatron":
        key = "actor_rollout_ref.model.use_fused_kernels"
        raise ConfigError(
            f"{why}; verl's Megatron engine computes it only from the logits: set {key}=False",
            key=key,
        )
    if backend != BACKEND:
        key = "actor_rollout_ref.model.fused_kernel_options.impl_backend"
        raise ConfigError(
            f"{why}; the fused forward {backend!r} does not return it: set {key}={BACKEND} "
            "(or actor_rollout_ref.model.use_fused_kernels=False)",
            key=key,
        )
    if not model.get("use_remove_padding", True):
        key = "actor_rollout_ref.model.use_remove_padding"
        raise ConfigError(
            f"{why}; impl_backend={BACKEND} returns it for packed batches: set {key}=True",
            key=key,
        )


def _patch_init(module) -> None:
    original = module.PPOTrainer.__init__

    def __init__(self, config, *args, **kwargs):
        check_v1_config(config)  # before verl builds anything
        original(self, config, *args, **kwargs)

    __init__._otbrl_original = original
    module.PPOTrainer.__init__ = __init__


def _patch_old_log_prob(module) -> None:
    original = module.PPOTrainer._compute_old_log_prob
    tq = module.tq

    def _compute_old_log_prob(self, batch, metrics):
        """verl's step with Σπ² requested from the actor's forward; ``[B, Lr]`` nested
        ``sum_pi_squared`` (float32, response tokens) in the TransferQueue afterwards."""
        if not sum_pi_squared_wanted(self.config):
            return original(self, batch, metrics)
        check_v1_config(self.config)  # a trainer built without __init__ is checked here
        batch.extra_info["calculate_sum_pi_squared"] = True
        try:
            out = original(self, batch, metrics)
        finally:
            # extra_info travels with the batch: a later forward on it (the reference's)
            # would compute Σπ² of another model and overwrite the actor's
            batch.extra_info.pop("calculate_sum_pi_squared", None)
        out.extra_info.pop("calculate_sum_pi_squared", None)
        data = tq.kv_batch_get(
            keys=batch.keys, partition_id=batch.partition_id, select_fields=[STAT, "response_mask"]
        )
        if STAT not in data:
            strategy = self.config.actor_rollout_ref.actor.get("strategy", None)
            raise RuntimeError(
                "the actor's compute_log_prob returned no sum_pi_squared although it was asked "
                f"(calculate_sum_pi_squared=True): actor_rollout_ref.actor.strategy={strategy}"
            )
        # the engine's output at position t is the distribution that predicts token t+1:
        # the same one-token shift verl applies to log_probs for old_log_probs
        values = module.response_from_nested(data[STAT], data["response_mask"])
        fields = module.TensorDict({STAT: values.to(module.torch.float32)}, batch_size=len(batch))
        out = tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=fields)
        return out

    _compute_old_log_prob._otbrl_original = original
    module.PPOTrainer._compute_old_log_prob = _compute_old_log_prob


def _patch_advantage(module) -> None:
    original = module.PPOTrainer._compute_advantage
    original_fn = module.compute_advantage_for_multi_trajectories
    tq = module.tq

    def _compute_advantage(self, batch, metrics):
        """verl's step, the batch's Σπ² (``[B, Lr]`` padded, float32) carried to the seam."""
        if not sum_pi_squared_wanted(self.config):
            return original(self, batch, metrics)
        data = tq.kv_batch_get(
            keys=batch.keys, partition_id=batch.partition_id, select_fields=[STAT, "response_mask"]
        )
        if STAT not in data:
            raise RuntimeError(
                "no sum_pi_squared in the TransferQueue for the advantage step: the old-log-prob "
                "step did not run the actor's forward (see otbrl.integrations.verl.trainer_v1)"
            )
        token = _CARRIED.set((list(batch.keys), data[STAT].to_padded_tensor(0.0)))
        try:
            return original(self, batch, metrics)
        finally:
            _CARRIED.reset(token)

    def compute_advantage_for_multi_trajectories(data, *args, **kwargs):
        """verl's function, with the carried ``[B, Lr]`` Σπ² in ``data.batch`` first."""
        carried = _CARRIED.get()
        if carried is not None:
            keys, values = carried
            mask = data.batch["response_mask"]
            if list(kwargs.get("batch_keys", keys)) != keys or values.shape != mask.shape:
                raise RuntimeError(
                    f"Σπ² {tuple(values.shape)} does not line up with the advantage step's batch "
                    f"{tuple(mask.shape)}"
                )
            data.batch[STAT] = values
        return original_fn(data, *args, **kwargs)

    _compute_advantage._otbrl_original = original
    compute_advantage_for_multi_trajectories._otbrl_original = original_fn
    module.PPOTrainer._compute_advantage = _compute_advantage
    module.compute_advantage_for_multi_trajectories = compute_advantage_for_multi_trajectories


def patch_trainer_module(module) -> bool:
    """Patch an imported ``verl.trainer.ppo.v1.trainer_base``; idempotent. Returns True."""
    if getattr(module.PPOTrainer._compute_old_log_prob, "_otbrl_original", None) is None:
        _patch_init(module)
        _patch_old_log_prob(module)
        _patch_advantage(module)
        logger.info("otbrl: verl's V1 trainer carries Σπ² to the advantage step")
    return True


def unpatch_trainer_module(module) -> None:
    """Put verl's own V1 step functions back (for tests: verl's failure without the plug-in)."""
    cls = module.PPOTrainer
    for name in ("__init__", "_compute_old_log_prob", "_compute_advantage"):
        original = getattr(cls.__dict__[name], "_otbrl_original", None)
        if original is not None:
            setattr(cls, name, original)
    fn = module.compute_advantage_for_multi_trajectories
    module.compute_advantage_for_multi_trajectories = getattr(fn, "_otbrl_original", fn)


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, and the patch once verl's code has run."""

    def __init__(self, loader, patch):
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        try:
            self.patch(module)
        except Exception as err:  # never break verl's import: say what is missing instead
            logger.warning(
                "otbrl: verl's V1 trainer not patched (OTB needs trainer.use_v1=False): %s: %s",
                type(err).__name__,
                err,
            )

    def __getattr__(self, name):  # get_code, get_source, ... for tracebacks and inspect
        return getattr(self.loader, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds ``MODULE`` through the other finders and wraps its loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname != MODULE:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, patch_trainer_module)
                return spec
        return None


def install_v1_trainer_patch() -> bool:
    """Patch verl's V1 trainer now if it is imported, else when it is; idempotent. True."""
    module = sys.modules.get(MODULE)
    if module is not None:
        return patch_trainer_module(module)
    if not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
    return True
