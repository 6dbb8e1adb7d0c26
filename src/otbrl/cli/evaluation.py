"""``otbrl eval`` and ``otbrl export``: the commands that read a trained model — a checkpoint,
a run directory (its newest verified checkpoint) or, for ``eval``, a plain model."""

from __future__ import annotations

import argparse
import sys

from otbrl.cli.common import load, usage_error
from otbrl.config import ConfigError


def evaluate(args: argparse.Namespace) -> int:
    """``otbrl eval``: validation accuracy of ``model.path``, with a checkpoint's own settings
    (less the code, sandbox switch and hosts it names) unless overridden."""
    base, ckpt = _checkpoint_config(args.overrides)
    if ckpt is not None:  # a run directory stands for its newest verified checkpoint
        from pathlib import Path

        from otbrl.models.lora import ADAPTER_CONFIG
        from otbrl.store.checkpoint import ADAPTER_DIR

        adapter = Path(ckpt) / ADAPTER_DIR
        others = [o for o in args.overrides if o.partition("=")[0].strip() != "model.path"]
        if (adapter / ADAPTER_CONFIG).is_file() and base is not None:
            # a LoRA checkpoint holds its adapter alone: the base it was trained on (the
            # saved model.path) with that adapter
            args.overrides = [*others, f"model.lora.adapter_path={adapter}"]
        else:
            args.overrides = [*others, f"model.path={ckpt}"]
    # a checkpoint's own settings (response budget, tools, reward...) unless overridden, but
    # not the code, sandbox switch or hosts it names (its config is data)
    dropped: list[str] = []
    if base is not None:
        given = {o.partition("=")[0].strip() for o in args.overrides}
        base, dropped = _trusted_for_eval(base, given)
    cfg = load(args, base=base)
    if base is not None:
        print(f"evaluating {ckpt} with the configuration it was trained with", file=sys.stderr)
    hint = (
        "not taken from the checkpoint's config (code it would run: give it again on the "
        f"command line to trust it): {', '.join(dropped)}"
    )
    if dropped:
        print(f"otbrl: {hint}", file=sys.stderr)
    from otbrl.run.plan import plan_run

    try:
        plan = plan_run(cfg, train=False)
    except ConfigError as err:  # e.g. a data source left without its reward: say why
        raise ConfigError(f"{err}; {hint}" if dropped else str(err), err.key) from None
    from otbrl.engine.world import local_world
    from otbrl.models import eos_token_ids
    from otbrl.rollout import HFRollout
    from otbrl.run.build import build_sampler, load_policy, model_path, scoring
    from otbrl.run.evaluate import validate

    spec = plan.spec
    path = model_path(spec.model)
    tokenizer = plan.tokenizer
    world = local_world()  # the GPU when there is one, as training's single process
    model = load_policy(spec, path, tokenizer).to(world.device)
    eos = eos_token_ids(model, tokenizer)
    backend = HFRollout(model, tokenizer)
    sampler = build_sampler(spec, plan.tools, backend, tokenizer, eos, str(path), plan.env)
    result = validate(
        sampler, tokenizer, plan.val_rows, spec, world=world, stop_token_ids=eos,
        seed=spec.seed, scoring=scoring(plan).for_validation(), label="evaluating",
    ).metrics  # fmt: skip
    rate = result.get("val/tool_call_rate")
    print(
        f"val accuracy: {result['val/accuracy']:.4f} on {len(plan.val_rows)} prompts "
        f"({ckpt or cfg.model.path})" + ("" if rate is None else f"; tool-call rate {rate:.3f}")
    )
    return 0


def _trusted_for_eval(saved: dict, given: set[str]) -> tuple[dict, list[str]]:
    """``otbrl eval``'s view of a checkpoint's saved config, which is data (it may come from
    someone else): the user code it names (a ``reward.function`` or tools given as
    ``path.py:fn``) and the sandbox's off switch are left out unless ``given`` on the command
    line (returned as ``key=value`` texts, to say so), and what eval does not use — the rollout
    engine and its servers (hosts it would contact), staleness, the logger, the learned reward
    model — falls back to the defaults."""
    import copy

    saved = copy.deepcopy(saved)
    dropped: list[str] = []
    reward, rollout = saved.setdefault("reward", {}), saved.setdefault("rollout", {})
    function = reward.get("function")
    if "reward.function" not in given and isinstance(function, str) and ":" in function:
        dropped.append(f"reward.function={function}")
        reward["function"] = None
    turn = rollout.get("multi_turn") or {}
    tools = [str(t) for t in turn.get("tools") or []]
    if "rollout.multi_turn.tools" not in given and any(":" in t for t in tools):
        dropped.append(f"rollout.multi_turn.tools=[{','.join(tools)}]")
        builtin = [t for t in tools if ":" not in t]
        if builtin:
            turn["tools"] = builtin
        else:  # no tools left: the group's other keys would be refused without them
            rollout.pop("multi_turn")
    code = reward.get("code") or {}
    if "reward.code.allow_unsandboxed" not in given and code.get("allow_unsandboxed"):
        dropped.append("reward.code.allow_unsandboxed=true")
        code["allow_unsandboxed"] = False
    for key in ("name", "mode", "server", "vllm", "stale_samples", "partial_rollout"):
        rollout.pop(key, None)
    saved.get("trainer", {}).pop("max_staleness", None)
    saved.get("trainer", {}).pop("logger", None)
    reward.pop("model", None)
    return saved, dropped


def _checkpoint_config(overrides: list[str]) -> tuple[dict | None, str | None]:
    """(the saved configuration, the checkpoint) when ``model.path`` names a checkpoint or a
    run directory with checkpoints; (None, None) for a plain model."""
    paths = [v for k, _, v in (o.partition("=") for o in overrides) if k.strip() == "model.path"]
    if not paths:
        return None, None
    from pathlib import Path

    from otbrl.store.checkpoint import resolve_checkpoint

    given = Path(paths[-1].strip())
    if not ((given / "checkpoint.json").is_file() or (given / "checkpoints").is_dir()):
        return None, None
    try:
        ckpt = resolve_checkpoint(given)
    except ValueError as err:
        why = str(err).removeprefix("path: ")
        raise ConfigError(f"'model.path': {why}", "model.path") from None
    saved = ckpt / "config.yaml"
    if not saved.is_file():
        return None, str(ckpt)
    import yaml

    return yaml.safe_load(saved.read_text()), str(ckpt)


def export(args: argparse.Namespace) -> int:
    """``otbrl export``: a checkpoint as a plain Hugging Face directory (or a PEFT adapter)."""
    from otbrl.store.checkpoint import resolve_checkpoint
    from otbrl.store.export import export_checkpoint

    try:
        ckpt = resolve_checkpoint(args.checkpoint)
        out = export_checkpoint(ckpt, args.out_dir, adapter_only=args.adapter_only)
        print(f"exported {ckpt}: {out}")
    except ValueError as err:  # a wrong path or a non-empty target: the user's to fix
        return usage_error(err)
    return 0
