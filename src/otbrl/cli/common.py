"""What every ``otbrl`` command shares: the configuration arguments, loading the configuration
(``--print-config`` ends the command there) and its ``Plan``, and the one-line usage error."""

from __future__ import annotations

import argparse
import sys

from otbrl.config import load_config

EXIT_CONFIG = 2


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """``--config``, ``--print-config`` and the dotted ``key=value`` overrides."""
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


def config_parser(sub, name: str, help_: str) -> argparse.ArgumentParser:
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
    add_config_args(parser)
    return parser


class Printed(Exception):
    """--print-config printed the configuration: the command ends there (exit 0)."""


def load(args: argparse.Namespace, extra: list[str] | None = None, *, base: dict | None = None):
    """The loaded config (presets, --config, then overrides over ``extra``); with
    --print-config it is printed and the command ends."""
    cfg = load_config(args.config, [*(extra or []), *args.overrides], base=base)
    if getattr(args, "print_config", False):
        from otbrl.config.describe import commented_yaml

        print(commented_yaml(cfg), end="")
        raise Printed
    return cfg


def config_and_plan(
    args: argparse.Namespace,
    extra: list[str] | None = None,
    *,
    train: bool = True,
    world_size: int | None = None,
):
    """The loaded config and its ``Plan`` for ``world_size`` processes (default: torchrun's
    ``WORLD_SIZE``), validated once, before any model loads."""
    from otbrl.run.plan import plan_run

    cfg = load(args, extra)
    return cfg, plan_run(cfg, world_size, train=train)


def usage_error(err: Exception) -> int:
    """``otbrl: error: <err>`` on stderr; the configuration-error exit status."""
    print(f"otbrl: error: {err}", file=sys.stderr)
    return EXIT_CONFIG
