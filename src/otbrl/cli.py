"""Command line: ``otbrl train | sft | eval | export | plot | demo | variance | compare``.

Configuration problems print one line naming the key and exit with status 2, before any model is
loaded; heavy modules are imported only once the configuration has been checked. ``train`` and
``demo`` also claim the run directory then (lock, manifest, same-config check, the verified
checkpoint to resume from): a second run on it, or a mismatched resume, exits 2 the same way.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Callable

from otbrl.config import ConfigError, load_config
from otbrl.rewards.scoring import RewardError

EXIT_CONFIG = 2
# the demo's promise is 10 minutes including the warm start; keep a margin for start-up,
# the final validation and the plot
DEMO_SECONDS = 560
# the demo's tuned preset (user overrides still win): two optimizer steps per RL step
DEMO_PRESET = [
    "trainer.output_dir=runs/demo",
    f"trainer.max_wall_seconds={DEMO_SECONDS}",
    "actor.ppo_mini_batch_size=16",
]


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file with config groups (data, model, actor, ...)")
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved configuration (every key, its value, what it means) as YAML "
        "and exit",
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. actor.lr=1e-6"
    )


def _config_parser(sub, name: str, help_: str) -> argparse.ArgumentParser:
    """A subcommand that takes the configuration; its --help lists every key."""
    from otbrl.config.describe import keys_help

    parser = sub.add_parser(
        name,
        help=help_,
        description=help_,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="configuration keys (key = schema default; the built-in model and tasks lay "
        f"their presets over these; see --print-config):\n{keys_help()}\n",
    )
    _add_config_args(parser)
    return parser


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="otbrl", description="RL post-training with the Optimal Token Baseline."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _config_parser(sub, "train", "run RL training")
    _config_parser(sub, "sft", "supervised warm start of the built-in model (cached)")
    _config_parser(
        sub, "eval", "validation accuracy of model.path: a model, a checkpoint or a run directory"
    )
    p = sub.add_parser("export", help="checkpoint -> plain Hugging Face directory")
    p.add_argument(
        "checkpoint",
        help="a run directory (its newest verified checkpoint) or a checkpoints/step_<k> directory",
    )
    p.add_argument("out_dir", help="directory to write")
    p.add_argument(
        "--adapter-only",
        action="store_true",
        help="a LoRA run: write the PEFT adapter alone (default: merged into its base model)",
    )
    p = sub.add_parser("plot", help="overlay the curves of one or more runs")
    p.add_argument("run_dirs", nargs="+", help="run output directories")
    p.add_argument("--out", default=None, help="PNG to write (default: <run>/curves.png)")
    _config_parser(sub, "demo", "warm start + RL with the defaults; prints accuracy gain")
    p = sub.add_parser(
        "compare", help="OTB vs GRPO at equal token budget over seeds", add_help=False
    )
    p = _config_parser(sub, "variance", "empirical gradient variance per estimator, with CIs")
    _add_variance_args(p)
    return parser


def _add_variance_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--estimators",
        default=None,
        help="comma-separated (default grpo,drgrpo,rloo,otb,otb_notail)",
    )
    p.add_argument("--n", default="16", help="group sizes, comma-separated (e.g. 4,16)")
    p.add_argument("--repeats", type=int, default=200, help="K repeats per group size")
    p.add_argument("--prompts", type=int, default=8, help="P prompts from the configured data")
    p.add_argument("--reference-samples", type=int, default=512, help="RLOO reference samples")
    p.add_argument("--base", default="grpo", help="estimator the ratios divide by")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    p.add_argument("--sketch-dim", type=int, default=None, help="0 = exact Gram; default auto")
    p.add_argument("--method", default="loop", choices=("loop", "batched"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="variance.json", help="JSON to write (PNG beside it)")


class _Printed(Exception):
    """--print-config printed the configuration: the command ends there (exit 0)."""


def _load(args: argparse.Namespace, extra: list[str] | None = None, *, base: dict | None = None):
    """The loaded config (presets, --config, then overrides over ``extra``); with
    --print-config it is printed and the command ends."""
    cfg = load_config(args.config, [*(extra or []), *args.overrides], base=base)
    if getattr(args, "print_config", False):
        from otbrl.config.describe import commented_yaml

        print(commented_yaml(cfg), end="")
        raise _Printed
    return cfg


def _config(args: argparse.Namespace, extra: list[str] | None = None, *, train: bool = True):
    """The loaded config and its ``Plan`` (validated once, before any model loads)."""
    from otbrl.run.plan import plan_run

    cfg = _load(args, extra)
    return cfg, plan_run(cfg, train=train)


def _train(args: argparse.Namespace) -> int:
    cfg, plan = _config(args)
    from otbrl.run.plan import claim_run_dir
    from otbrl.run.trainer import Trainer

    run = claim_run_dir(cfg)  # still before any model loads
    # one process, or one per device under torchrun: the same loop
    Trainer(cfg, plan, run).fit()
    return 0


def _demo(args: argparse.Namespace) -> int:
    cfg, plan = _config(args, DEMO_PRESET)
    from otbrl.run.plan import claim_run_dir
    from otbrl.run.trainer import Trainer

    start = time.perf_counter()
    run = claim_run_dir(cfg)
    trainer = Trainer(cfg, plan, run)  # pays for the warm start the first time, then cached
    if cfg.trainer.max_wall_seconds > 0:
        # the demo's wall budget covers the warm start: RL gets what the warm start left
        spent = time.perf_counter() - start
        trainer.settings.max_wall_seconds = max(1.0, cfg.trainer.max_wall_seconds - spent)
    summary = trainer.fit()
    before, after = summary.get("initial_val_accuracy"), summary.get("final_val_accuracy")
    wall = time.perf_counter() - start
    if before is None or after is None:
        print(f"demo finished in {wall:.0f} s (validation was off)")
        return 0
    print(
        f"validation accuracy: {before:.3f} (warm start) -> {after:.3f} (after RL, "
        f"{cfg.algorithm.adv_estimator}), gain {after - before:+.3f}; "
        f"{wall:.0f} s incl. warm start; curves: {cfg.trainer.output_dir}/curves.png"
    )
    if "final_val_accuracy_without_tools" in summary:
        rates = [summary.get(f"{k}_val_tool_call_rate") for k in ("initial", "final")]
        if None not in rates:
            print(f"tool-call rate: {rates[0]:.3f} -> {rates[1]:.3f}", end="; ")
        print(
            f"the final policy without its tools: {summary['final_val_accuracy_without_tools']:.3f}"
        )
    return 0


def _sft(args: argparse.Namespace) -> int:
    cfg, plan = _config(args)
    if cfg.model.path != "builtin":
        raise ConfigError(
            "'model.path' must be 'builtin' for 'otbrl sft' (it warm-starts the built-in model)",
            "model.path",
        )
    from otbrl.run.build import model_path

    path = model_path(plan.spec.model)
    print(f"warm-started model: {path}")
    return 0


def _eval(args: argparse.Namespace) -> int:
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
    cfg = _load(args, base=base)
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
    sampler = build_sampler(spec, plan.tools, backend, tokenizer, eos, str(path))
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


def _export(args: argparse.Namespace) -> int:
    from otbrl.store.checkpoint import resolve_checkpoint
    from otbrl.store.export import export_checkpoint

    try:
        ckpt = resolve_checkpoint(args.checkpoint)
        out = export_checkpoint(ckpt, args.out_dir, adapter_only=args.adapter_only)
        print(f"exported {ckpt}: {out}")
    except ValueError as err:  # a wrong path or a non-empty target: the user's to fix
        return _usage_error(err)
    return 0


def _usage_error(err: Exception) -> int:
    print(f"otbrl: error: {err}", file=sys.stderr)
    return EXIT_CONFIG


def _plot(args: argparse.Namespace) -> int:
    from otbrl.report.plots import plot_run, plot_runs

    try:
        if len(args.run_dirs) == 1 and args.out is None:
            print(f"wrote {plot_run(args.run_dirs[0])}")
        else:
            print(f"wrote {plot_runs(args.run_dirs, args.out or 'curves.png')}")
    except ValueError as err:  # not a run directory
        return _usage_error(err)
    return 0


def _variance(args: argparse.Namespace) -> int:
    cfg = _load(args)
    if cfg.algorithm.distill.teacher_path is not None:  # before the plan loads its tokenizer
        raise ConfigError(
            "'algorithm.distill.teacher_path': otbrl variance measures the gradient of the task "
            "reward alone (no teacher, no in-reward KL); drop the key",
            "algorithm.distill.teacher_path",
        )
    from otbrl.run.plan import plan_run

    plan = plan_run(cfg)
    from otbrl.research.variance import DEFAULT_ESTIMATORS, check_variance_args, run_variance

    try:
        ns = [int(x) for x in args.n.split(",")]
        kwargs = {
            "estimators": args.estimators or DEFAULT_ESTIMATORS,
            "ns": ns,
            "repeats": args.repeats,
            "prompts": args.prompts,
            "reference_samples": args.reference_samples,
            "base": args.base or None,
        }
        check_variance_args(**kwargs)
    except ValueError as err:  # bad flags: one line, before any model loads
        raise ConfigError(f"otbrl variance: {err}", "variance") from None
    run_variance(
        cfg,
        plan,
        **kwargs,
        out=args.out,
        num_bootstrap=args.bootstrap,
        sketch_dim=args.sketch_dim,
        method=args.method,
        seed=args.seed,
    )
    return 0


def _compare(args: argparse.Namespace) -> int:
    from otbrl.research.compare import main as compare_main

    return compare_main(args.args)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "train": _train,
    "sft": _sft,
    "eval": _eval,
    "export": _export,
    "plot": _plot,
    "demo": _demo,
    "variance": _variance,
    "compare": _compare,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``otbrl`` and ``python -m otbrl``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["compare"]:  # has its own parser (otbrl.research.compare.main)
            args = argparse.Namespace(command="compare", args=list(argv[1:]))
        else:
            args = _build_parser().parse_args(argv)
    except SystemExit as exit_:  # argparse already printed usage + the error
        return int(exit_.code or 0)
    restore = _interrupt_on_termination()
    try:
        return COMMANDS[args.command](args)
    except _Printed:
        return 0
    except ConfigError as err:
        print(f"otbrl: config error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    except RewardError as err:  # user code failed under reward.on_error=raise
        print(f"otbrl: error: {err}", file=sys.stderr)
        return 1
    except RuntimeError as err:
        from otbrl.engine.trainable import NumericsError  # torch is loaded: a trainer ran
        from otbrl.rollout.server import ServerError

        if not isinstance(err, NumericsError | ServerError):
            raise
        # weights or steps went non-finite, or a vLLM server failed past its restarts
        print(f"otbrl: error: {err}", file=sys.stderr)
        return 1
    except FileNotFoundError as err:
        print(f"otbrl: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:
        if not getattr(err, "otbrl_reported", False):  # the trainer said what it kept
            print("otbrl: interrupted", file=sys.stderr)
        return 128 + getattr(err, "signum", signal.SIGINT)
    finally:
        restore()


class _Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (``docker stop``, a torchrun restart, a closed terminal), raised where
    Ctrl-C would be: the same clean-up runs — servers, reward workers and tools stopped, weight
    buckets removed — instead of the process vanishing and orphaning them."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt_on_termination():
    """Turn SIGTERM and SIGHUP into ``_Terminated`` for the command's life (main thread only:
    where Python can install handlers); returns what restores the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def raise_terminated(signum, frame):
        raise _Terminated(signum)

    # a signal someone set to be ignored (nohup: SIGHUP) or handled stays as it is
    mine = [s for s in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) is signal.SIG_DFL]
    previous = {sig: signal.signal(sig, raise_terminated) for sig in mine}
    return lambda: [signal.signal(sig, handler) for sig, handler in previous.items()]
