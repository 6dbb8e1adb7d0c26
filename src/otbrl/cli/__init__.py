"""Command line: ``otbrl train | sft | eval | export | plot | demo | variance | compare | serve``.

Configuration problems print one line naming the key and exit with status 2, before any model is
loaded; heavy modules are imported only once the configuration has been checked. ``train`` and
``demo`` also claim the run directory then (lock, manifest, same-config check, the verified
checkpoint to resume from): a second run on it, or a mismatched resume, exits 2 the same way.

This module holds the parser, the dispatch and how a command ends (exit statuses, signals); the
commands live by group: ``cli.training`` (train, demo, sft), ``cli.evaluation`` (eval, export),
``cli.research`` (plot, variance, compare), what they share in ``cli.common``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable

from otbrl.cli.common import EXIT_CONFIG, Printed, config_parser
from otbrl.cli.evaluation import evaluate, export
from otbrl.cli.launch import LAUNCHED
from otbrl.cli.research import add_variance_args, compare, plot, variance
from otbrl.cli.serve import add_serve_args, serve
from otbrl.cli.training import DEMO_PRESET, DEMO_SECONDS, demo, sft, train
from otbrl.config import ConfigError
from otbrl.config.load import RenamedKeyWarning
from otbrl.rewards.scoring import RewardError

# how long a rank other than 0 waits, after a configuration error, for torchrun to stop it
RANK_WAIT_S = 60.0

__all__ = ["COMMANDS", "DEMO_PRESET", "DEMO_SECONDS", "EXIT_CONFIG", "main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="otbrl", description="RL post-training with the Optimal Token Baseline."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = config_parser(sub, "train", "run RL training")
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        metavar="N",
        help="train in N processes on this machine (data parallel, or the layout of actor.*): "
        "the configuration is checked once, then torch.distributed.run starts them; across "
        "machines, run torchrun -m otbrl train on each",
    )
    config_parser(sub, "sft", "supervised warm start of the built-in model (cached)")
    config_parser(
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
    config_parser(sub, "demo", "warm start + RL with the defaults; prints accuracy gain")
    p = sub.add_parser(
        "compare", help="OTB vs GRPO at equal token budget over seeds", add_help=False
    )
    p = config_parser(sub, "variance", "empirical gradient variance per estimator, with CIs")
    add_variance_args(p)
    p = sub.add_parser(
        "serve",
        help="a vLLM rollout server for rollout.server.urls (otbrl's secret and middleware)",
        description="Start a vLLM rollout server the way otbrl starts its own, print the "
        "lines the trainer needs (the secret, rollout.server.urls), serve until Ctrl-C.",
    )
    add_serve_args(p)
    return parser


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "train": train,
    "sft": sft,
    "eval": evaluate,
    "export": export,
    "plot": plot,
    "demo": demo,
    "variance": variance,
    "compare": compare,
    "serve": serve,
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
        with _user_warnings():
            return COMMANDS[args.command](args)
    except Printed:
        return 0
    except ConfigError as err:
        report_config_error(err)
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


@contextlib.contextmanager
def _user_warnings():
    """otbrl's warnings to the user (a key under its old name) as one ``otbrl: warning:`` line,
    not Python's file, line number and source line; other warnings as before."""
    with warnings.catch_warnings():
        default = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, RenamedKeyWarning):
                print(f"otbrl: warning: {message}", file=sys.stderr)
            else:
                default(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


def report_config_error(err: ConfigError) -> None:
    """``otbrl: config error: ...`` on stderr, one line — from rank 0 alone when several
    processes check the same configuration (torchrun's ranks); under a torchrun that otbrl did
    not start, rank 0 adds one line on the failure report torchrun prints next."""
    if int(os.environ.get("RANK", "0")) != 0:
        # rank 0 says it: every rank checked the same configuration. A rank that exits first
        # makes torchrun stop the others, rank 0 too, before it has said it (seen under load):
        # wait for torchrun to stop this rank after rank 0 exits; still running a minute later,
        # rank 0 did not stop on it (a file missing on this node alone): say it
        if "TORCHELASTIC_RUN_ID" in os.environ:
            try:
                time.sleep(RANK_WAIT_S)
            except KeyboardInterrupt:  # torchrun's SIGTERM (see _Terminated): quietly
                return
            print(f"otbrl: config error (rank {os.environ['RANK']}): {err}", file=sys.stderr)
        return
    print(f"otbrl: config error: {err}", file=sys.stderr)
    if "TORCHELASTIC_RUN_ID" in os.environ and LAUNCHED not in os.environ:
        print(
            "otbrl: every rank stopped on the line above; torchrun's failure report below is "
            "about it (otbrl train --nproc-per-node=N checks the configuration before it "
            "starts the processes, and says only that line)",
            file=sys.stderr,
        )


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
