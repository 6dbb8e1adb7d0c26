"""reasoning-gym's procedural datasets as tasks: ``data.task=reasoning_gym:NAME`` (one dataset)
or ``reasoning_gym:NAME=WEIGHT,NAME=WEIGHT`` (reasoning-gym's composite, drawn by weight).

A row is the dataset entry in the RL-parquet schema: the question as the user message (after
reasoning-gym's own system prompt, which asks for the answer in ``<answer>`` tags), data_source
``reasoning_gym/NAME`` (the entry's own dataset, in a composite too), the reference answer as the
ground truth (``""`` for datasets that have none and verify an answer instead), and the entry
itself in ``extra_info.reasoning_gym_entry`` with its dataset's options in
``extra_info.reasoning_gym_options``: the reward (``otbrl.rewards.reasoning_gym``) scores with
that dataset's own ``score_answer`` from the row alone (a parquet export scores the same). The
entry is kept as typed JSON (``encode_entry``): its metadata holds tuples, NumPy arrays and
dicts with int keys that ``score_answer`` compares, and plain JSON would turn them into lists
and strings. (Regenerating the entry from its seed and index is no alternative: some datasets,
``codeio`` among them, draw from a stream shared across entries.)

Options of the dataset come from ``data.task_options`` (for a composite, one mapping per dataset
name); sizes and seeds from the data keys: ``data.train_size`` training entries (default
``DEFAULT_TRAIN_SIZE``), ``data.val_size`` validation ones, both generated from ``data.seed``
(the validation entries from another seed: procedural generators may repeat an entry, so the
splits are drawn apart, not guaranteed disjoint). reasoning-gym is imported only here, when such
a task is built (``pip install reasoning-gym``; ``make setup`` installs it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from fractions import Fraction

import numpy as np

from otbrl.data.tasks import Task

TASK_PREFIX = "reasoning_gym:"  # data.task=reasoning_gym:NAME
SOURCE_PREFIX = "reasoning_gym/"  # each row's data_source
DEFAULT_TRAIN_SIZE = 10_000
VAL_SEED_OFFSET = 1_000_003  # the validation entries' generator seed: data.seed + this
INSTALL_HINT = "reasoning-gym is not installed: pip install reasoning-gym==0.1.25 (make setup)"


def parse_spec(spec: str) -> dict[str, float]:
    """``"NAME"`` -> ``{NAME: 1.0}``; ``"A=2,B=1"`` -> weights per dataset name. A name the
    installed reasoning-gym does not list, or a weight that is not a number > 0, is a
    ``ValueError`` naming it."""
    datasets = _datasets()
    out: dict[str, float] = {}
    for part in spec.split(","):
        name, sep, weight = part.strip().partition("=")
        if name not in datasets or name == "composite":
            close = sorted(n for n in datasets if name[:4] in n)[:5]
            raise ValueError(
                f"reasoning-gym has no dataset {name!r} (there are {len(datasets)}: "
                f'{close or sorted(datasets)[:5]}...; `python -c "from reasoning_gym.factory '
                'import DATASETS; print(sorted(DATASETS))"` lists them)'
            )
        try:
            value = float(weight) if sep else 1.0
        except ValueError:
            value = -1.0
        if not value > 0:
            raise ValueError(f"reasoning-gym dataset {name!r}: weight {weight!r} is not > 0")
        out[name] = value
    return out


class ReasoningGymTask(Task):
    """One reasoning-gym dataset, or a weighted composite of several (module docstring).

    Args:
        spec: ``NAME`` or ``NAME=WEIGHT,...``.
        options: the dataset's config fields (a composite: ``{NAME: {field: value}}``).
        train_size / val_size: entries per split.
    """

    alphabet = ""  # a user's model: no built-in tokenizer
    max_response_chars = 0  # no length the answers are known to fit

    def __init__(
        self,
        spec: str,
        options: Mapping | None = None,
        *,
        train_size: int = DEFAULT_TRAIN_SIZE,
        val_size: int = 500,
    ):
        self.weights = parse_spec(spec)
        self.name = TASK_PREFIX + spec
        options = dict(options or {})
        composite = len(self.weights) > 1
        if composite and set(options) - set(self.weights):
            unknown = sorted(set(options) - set(self.weights))
            raise ValueError(
                f"task_options: {unknown} are not datasets of {spec!r}: a composite takes one "
                "mapping of options per dataset name"
            )
        self.options = {
            name: dict(options.get(name) or {}) if composite else options for name in self.weights
        }
        self.data_source = SOURCE_PREFIX + next(iter(self.weights))
        self.sizes = {"train": train_size, "val": val_size}
        self._pools = {split: np.arange(size) for split, size in self.sizes.items()}
        self._cache: dict[tuple[str, int], object] = {}

    def rows(self, split: str, n: int | None = None, seed: int = 0) -> list[dict]:
        """The first ``n`` entries (all of the split's when None) the split's generator makes
        from ``seed``, in order."""
        size = len(self._split(split))
        n = size if n is None else n
        if not isinstance(n, int) or not 0 < n <= size:
            raise ValueError(f"n: expected an int in [1, {size}] for split {split!r}, got {n!r}")
        dataset = self._dataset(split, seed)
        return [self._entry_row(split, i, dataset[i]) for i in range(n)]

    def demonstration(self, row: dict) -> str:
        """The reference answer in the tags the system prompt asks for."""
        return f"<answer>{row['reward_model']['ground_truth']}</answer>"

    def _dataset(self, split: str, seed: int):
        key = (split, seed)
        if key not in self._cache:
            self._cache[key] = make_dataset(
                self.weights,
                self.options,
                size=self.sizes[split],
                seed=_split_seed(split, seed),
            )
        return self._cache[key]

    def _entry_row(self, split: str, index: int, entry: Mapping) -> dict:
        from reasoning_gym.utils import SYSTEM_PROMPTS

        source = entry.get("metadata", {}).get("source_dataset") or next(iter(self.weights))
        answer = entry.get("answer")
        return {
            "prompt": [
                {"role": "system", "content": SYSTEM_PROMPTS["default"]},
                {"role": "user", "content": entry["question"]},
            ],
            "data_source": SOURCE_PREFIX + source,
            "ability": "reasoning",
            "reward_model": {"style": "rule", "ground_truth": "" if answer is None else answer},
            "extra_info": {
                "split": split,
                "index": index,
                "reasoning_gym_entry": encode_entry(entry),
                "reasoning_gym_options": json.dumps(self.options[source], sort_keys=True),
            },
        }


def encode_entry(entry) -> str:
    """An entry as typed JSON: tuples, sets, NumPy arrays and scalars, fractions and dicts with
    keys that are not strings keep their types through ``decode_entry``. Another type is a
    ``ValueError`` naming it (such a dataset cannot be stored in a row)."""
    return json.dumps(_tag(entry), allow_nan=True)


def decode_entry(text: str):
    """``encode_entry``'s inverse."""
    return _untag(json.loads(text))


def _tag(value):
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list):
        return [_tag(v) for v in value]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and k != "__t" for k in value):
            return {k: _tag(v) for k, v in value.items()}
        return {"__t": "dict", "v": [[_tag(k), _tag(v)] for k, v in value.items()]}
    for kind, types in (("tuple", tuple), ("set", set), ("frozenset", frozenset)):
        if isinstance(value, types):
            return {"__t": kind, "v": [_tag(v) for v in value]}
    if isinstance(value, Fraction):
        return {"__t": "fraction", "v": str(value)}
    if isinstance(value, np.ndarray):
        return {"__t": "ndarray", "dtype": str(value.dtype), "v": _tag(value.tolist())}
    if isinstance(value, np.generic):
        return {"__t": "numpy", "dtype": str(value.dtype), "v": _tag(value.item())}
    raise ValueError(f"a reasoning-gym entry holds a {type(value).__name__}, not storable")


def _untag(value):
    if isinstance(value, list):
        return [_untag(v) for v in value]
    if not isinstance(value, dict):
        return value
    kind = value.get("__t")
    if kind is None:
        return {k: _untag(v) for k, v in value.items()}
    inner = value["v"]
    if kind == "dict":
        return {_hashable(_untag(k)): _untag(v) for k, v in inner}
    if kind in ("tuple", "set", "frozenset"):
        items = [_hashable(_untag(v)) for v in inner] if kind != "tuple" else _untag(inner)
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[kind](items)
    if kind == "fraction":
        return Fraction(inner)
    if kind == "ndarray":
        return np.array(_untag(inner), dtype=value["dtype"])
    return np.dtype(value["dtype"]).type(_untag(inner))


def _hashable(value):
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


def _split_seed(split: str, seed: int) -> int:
    """The seed a split's generator starts from: the validation entries are drawn apart."""
    return seed + (VAL_SEED_OFFSET if split == "val" else 0)


def make_dataset(weights: Mapping[str, float], options: Mapping[str, Mapping], *, size, seed):
    """reasoning-gym's dataset of ``size`` entries from ``seed``: the one named, or its
    composite of several by weight. A bad option is a ``ValueError`` naming the dataset."""
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    try:
        if len(weights) == 1:
            ((name, _),) = weights.items()
            return reasoning_gym.create_dataset(name, size=size, seed=seed, **options[name])
        from reasoning_gym.composite import DatasetSpec

        specs = [DatasetSpec(n, w, dict(options[n])) for n, w in weights.items()]
        return reasoning_gym.create_dataset("composite", size=size, seed=seed, datasets=specs)
    except (TypeError, ValueError, AssertionError) as err:
        raise ValueError(f"reasoning-gym {sorted(weights)}: {type(err).__name__}: {err}") from None


def _datasets() -> dict:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    return DATASETS
