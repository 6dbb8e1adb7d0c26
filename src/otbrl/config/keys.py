"""What each key of the CLI's schema is, read from its field's declaration
(``otbrl.settings.setting``) — never listed by hand beside it:

- ``RESUME_MAY_DIFFER``: the keys that may change when a run is resumed (``resume="may_differ"``:
  layout, micro-batching, logging, saving, timeouts, where work runs — they change no result);
  any other difference would mix two runs' steps (``otbrl.store.rundir`` refuses it);
- ``ESTIMATOR_OPTION_KEYS``: estimator option -> the key that sets it
  (``estimator_option="gamma"``; ``otbrl.run.spec.estimator_options`` hands them over);
- ``LIST_KEYS``: the keys typed ``list[...]``, whose bare command-line value is a one-element
  list (``data.train_files=a.parquet``).

Importing this imports no torch.
"""

from __future__ import annotations

from dataclasses import Field

from otbrl.config.schema import Config
from otbrl.settings import is_list, leaf_fields

# every leaf key of the schema -> its field (the actor's and the critic's optimizer keys share
# the fields OptimConfig declares)
SCHEMA_FIELDS: dict[str, Field] = leaf_fields(Config)

RESUME_MAY_DIFFER = frozenset(
    key for key, f in SCHEMA_FIELDS.items() if f.metadata.get("resume") == "may_differ"
)


def _estimator_options() -> dict[str, str]:
    out: dict[str, str] = {}
    for key, f in SCHEMA_FIELDS.items():
        option = f.metadata.get("estimator_option")
        if option is None:
            continue
        if option in out:
            raise ValueError(f"estimator option {option!r} is set by {out[option]} and {key}")
        out[option] = key
    return out


ESTIMATOR_OPTION_KEYS = _estimator_options()

LIST_KEYS = frozenset(key for key, f in SCHEMA_FIELDS.items() if is_list(f))


def undeclared_resume() -> list[str]:
    """The schema's keys that declare no resume safety (none should: a field of a component's
    settings is a ``setting(..., resume=...)``)."""
    return [key for key, f in SCHEMA_FIELDS.items() if f.metadata.get("resume") is None]
