"""``otbrl train --nproc-per-node N``: the configuration checked once, here, then N processes
on this machine under PyTorch's own launcher (``torch.distributed.run``, what ``torchrun``
runs) — one line and exit 2 for a configuration error, where ``torchrun -m otbrl train`` makes
every rank check it and then prints its own failure report.

The processes run ``python -m otbrl train`` with the same arguments; each rank's configuration
errors are said by rank 0 alone (``otbrl.cli.report_config_error``), and this launcher maps a
rank's failure to one line and its exit status instead of the launcher's traceback and report.
"""

from __future__ import annotations

import logging
import os
import sys

# set in the processes this launcher starts: a rank's configuration error needs no word about
# torchrun's report (there is none)
LAUNCHED = "OTBRL_LAUNCHED"


def launch(argv: list[str], nproc: int, *, env: dict[str, str] | None = None) -> int:
    """Run ``python -m otbrl <argv>`` in ``nproc`` processes on this machine (a standalone
    rendezvous on a free port) with ``env`` added to their environment, and wait for them;
    returns 0, the failed rank's exit status (a configuration error: 2, already said by rank
    0), or 1 with one line naming the rank."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ.update(env or {})
    os.environ[LAUNCHED] = "1"
    # torchrun's default for each process, set here so it does not print a banner saying so
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the launcher's own logs (its banner, "failed (exitcode ...)" lines): the failure is said
    # below in one line; the ranks' own output reaches the terminal as it is
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    args = parse_args(["--standalone", f"--nproc-per-node={nproc}", "--module", "otbrl", *argv])
    try:
        run(args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        code = failure.exitcode
        if code == 2:  # a configuration error: rank 0 said it
            return 2
        how = f"signal {-code}" if code < 0 else f"exit status {code}"
        print(
            f"otbrl: error: rank {rank} stopped with {how} (its output is above)", file=sys.stderr
        )
        return code if code > 0 else 1
    return 0
