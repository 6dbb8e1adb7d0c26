"""Empirical gradient variance of several advantage estimators, with paired bootstrap CIs.

Setting: K independent repeats; in repeat k every estimator e computes its policy gradient
g_ek ∈ R^P on the *same* sampled responses. Per estimator, with ḡ = (1/K) Σ_k g_k:

    variance          tr Σ̂ = (Σ_k ‖g_k‖² − K ‖ḡ‖²) / (K − 1)        unbiased trace of the covariance
    signal_norm_sq    ‖ḡ‖² − tr Σ̂ / K                                unbiased for ‖E g‖²
    signal_scale      ḡ · r̂,   r̂ = r / ‖r‖                           mean gradient along a reference
    variance_per_signal   tr Σ̂ / signal_scale²                        noise per unit of useful step

The reference r is an unbiased high-sample gradient (e.g. RLOO with many samples): an
estimator whose expected gradient is shrunk (a baseline that includes the sample itself) or
tilted gets a smaller scale, so "variance per signal" compares estimators at equal step size.

Everything above is a function of three per-repeat summaries, so K × P never has to be held:
``‖g_k‖²``, ``g_k · r̂`` and the running sum Σ_k g_k (exact, O(P) memory). The paired bootstrap
(resample repeats with replacement, jointly for all estimators, so the correlation between
estimators evaluated on the same samples is kept) additionally needs the K × K Gram matrix
G_ij = g_i · g_j of each estimator, because ‖Σ_k w_k g_k‖² = wᵀ G w. The accumulator builds it
either exactly (keeping the K gradients, E·K·P floats) or from a CountSketch of dimension D
(E·K·D floats, O(P) work per gradient): the sketch is unbiased for every dot product and is used
only for the bootstrap *fluctuations*; point estimates always come from the exact sums.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

# output key of each ratio family -> the statistic it divides
_RATIOS = (("ratios", "variance"), ("ratios_per_signal", "variance_per_signal"))


class RepeatMoments(NamedTuple):
    """Per-repeat summaries of E estimators over K repeats (float64).

    ``norm_sq`` [E, K]: ‖g_ek‖²; ``ref_dots`` [E, K]: g_ek · r̂; ``total_sq`` [E]: ‖Σ_k g_ek‖²
    (exact); ``gram`` [E, K, K] or None: g_ei · g_ej (exact or sketched, diagonal exact).
    """

    norm_sq: Tensor
    ref_dots: Tensor
    total_sq: Tensor
    gram: Tensor | None


def _unit_reference(reference: Tensor, num_params: int) -> Tensor:
    if not isinstance(reference, Tensor):
        raise TypeError(f"reference: expected a torch.Tensor, got {type(reference).__name__}")
    if reference.dim() != 1 or reference.numel() != num_params:
        raise ValueError(
            f"reference: expected shape [{num_params}] (the parameter count), "
            f"got {list(reference.shape)}"
        )
    ref = reference.detach().to(torch.float64)
    norm = ref.norm()
    if not torch.isfinite(norm) or norm == 0:
        raise ValueError(f"reference: expected a finite non-zero vector, got norm {norm.item()}")
    return ref / norm


def repeat_moments(grads: Tensor, reference: Tensor, *, gram: bool = True) -> RepeatMoments:
    """Exact summaries of per-repeat gradients held in memory.

    ``grads`` [E, K, P] (estimator, repeat, parameter); ``reference`` [P]. ``gram=False`` skips
    the [E, K, K] Gram matrix (point estimates only; needed when K is large).
    """
    if not isinstance(grads, Tensor):
        raise TypeError(f"grads: expected a torch.Tensor, got {type(grads).__name__}")
    if grads.dim() != 3:
        raise ValueError(f"grads: expected shape [E, K, P], got {list(grads.shape)}")
    r = _unit_reference(reference, grads.shape[2])
    g = grads.detach().to(torch.float64)
    return RepeatMoments(
        norm_sq=(g * g).sum(-1),
        ref_dots=g @ r,
        total_sq=g.sum(1).pow(2).sum(-1),
        gram=g @ g.transpose(1, 2) if gram else None,
    )


class GradientVarianceAccumulator:
    """Streaming summaries: call ``add(grads [E, P])`` once per repeat, then ``moments()``.

    ``sketch_dim=None`` keeps the gradients (float32, E·K·P) for an exact Gram matrix;
    ``sketch_dim=D`` keeps a CountSketch of each (E·K·D) instead; ``bootstrap=False`` keeps
    neither (point estimates only, O(E·P) memory).
    """

    def __init__(
        self,
        num_estimators: int,
        reference: Tensor,
        *,
        bootstrap: bool = True,
        sketch_dim: int | None = None,
        seed: int = 0,
    ):
        if not isinstance(num_estimators, int) or num_estimators < 1:
            raise ValueError(f"num_estimators: expected an int >= 1, got {num_estimators!r}")
        if sketch_dim is not None and (not isinstance(sketch_dim, int) or sketch_dim < 1):
            raise ValueError(f"sketch_dim: expected None or an int >= 1, got {sketch_dim!r}")
        if not isinstance(reference, Tensor):
            raise TypeError(f"reference: expected a torch.Tensor, got {type(reference).__name__}")
        self.num_estimators = num_estimators
        self.reference = _unit_reference(reference, reference.numel())
        num_params = self.reference.numel()
        self.bootstrap = bootstrap
        self.sketch_dim = sketch_dim
        self._sum = torch.zeros(num_estimators, num_params, dtype=torch.float64)
        self._norm_sq: list[Tensor] = []
        self._ref_dots: list[Tensor] = []
        self._rows: list[Tensor] = []  # kept gradients or their sketches, one [E, ·] per repeat
        if bootstrap and sketch_dim is not None:
            gen = torch.Generator().manual_seed(seed)
            self._bucket = torch.randint(sketch_dim, (num_params,), generator=gen)
            self._sign = torch.randint(2, (num_params,), generator=gen).to(torch.float64) * 2 - 1

    @property
    def num_repeats(self) -> int:
        """Repeats added so far."""
        return len(self._norm_sq)

    def add(self, grads: Tensor) -> None:
        """Record one repeat: ``grads`` [E, P], every estimator's gradient on the same samples."""
        expected = [self.num_estimators, self.reference.numel()]
        if not isinstance(grads, Tensor) or list(grads.shape) != expected:
            got = list(grads.shape) if isinstance(grads, Tensor) else type(grads).__name__
            raise ValueError(f"grads: expected shape {expected}, got {got}")
        g = grads.detach().to(torch.float64)
        if not torch.isfinite(g).all():
            raise ValueError(f"grads: repeat {self.num_repeats} has non-finite entries")
        self._sum += g
        self._norm_sq.append((g * g).sum(-1))
        self._ref_dots.append(g @ self.reference)
        if not self.bootstrap:
            return
        if self.sketch_dim is None:
            self._rows.append(grads.detach().to(torch.float32).clone())
        else:
            sketch = torch.zeros(self.num_estimators, self.sketch_dim, dtype=torch.float64)
            sketch.index_add_(1, self._bucket, g * self._sign)
            self._rows.append(sketch)

    def moments(self) -> RepeatMoments:
        """Summaries of the repeats added so far (Gram matrix only if ``bootstrap``)."""
        if self.num_repeats < 2:
            raise ValueError(f"num_repeats: expected >= 2 repeats, got {self.num_repeats}")
        norm_sq = torch.stack(self._norm_sq, 1)
        gram = None
        if self.bootstrap:
            rows = torch.stack(self._rows, 1)  # [E, K, P or D]
            gram = torch.zeros(
                self.num_estimators, rows.shape[1], rows.shape[1], dtype=torch.float64
            )
            # chunks over the last axis bound the float64 working copy for large P
            for start in range(0, rows.shape[2], 1 << 16):
                part = rows[:, :, start : start + (1 << 16)].to(torch.float64)
                gram += part @ part.transpose(1, 2)
            gram.diagonal(dim1=1, dim2=2).copy_(norm_sq)
        return RepeatMoments(
            norm_sq=norm_sq,
            ref_dots=torch.stack(self._ref_dots, 1),
            total_sq=self._sum.pow(2).sum(-1),
            gram=gram,
        )


def _statistics(m: RepeatMoments, weights: Tensor | None) -> dict[str, Tensor]:
    """The four statistics for each estimator under repeat weights ``weights`` [B, K] (integer
    counts; a row's sum is its number of repeats), or once with all weights 1 (``None``: from
    the exact sums). Results are [E, B]."""
    if weights is None:
        k = torch.tensor(float(m.norm_sq.shape[1]), dtype=torch.float64)
        quad = m.total_sq[:, None]
        sum_norm_sq = m.norm_sq.sum(1, keepdim=True)
        ref_sum = m.ref_dots.sum(1, keepdim=True)
    else:
        k = weights.sum(-1)  # [B]
        # ‖Σ w_k g_k‖² = wᵀ G w, shifted so that w = 1 reproduces the exact total
        quad = ((weights @ m.gram) * weights).sum(-1)  # [E, B]
        quad = quad + (m.total_sq - m.gram.sum((1, 2)))[:, None]
        sum_norm_sq = m.norm_sq @ weights.T
        ref_sum = m.ref_dots @ weights.T
    variance = (sum_norm_sq - quad / k) / (k - 1)
    scale = ref_sum / k
    return {
        "variance": variance,
        "signal_norm_sq": quad / k**2 - variance / k,
        "signal_scale": scale,
        "variance_per_signal": variance / scale.pow(2),
    }


def bca_intervals(
    point: Tensor, boot: Tensor, jackknife: Tensor, confidence: float = 0.95
) -> Tensor:
    """Bias-corrected and accelerated bootstrap intervals (Efron 1987), one per statistic.

    ``point`` [S], ``boot`` [S, B] (the statistics on B bootstrap resamples), ``jackknife``
    [S, K] (on the K leave-one-out samples) -> [S, 2] (lo, hi). The plain percentile interval
    under-covers for skewed statistics such as a variance ratio at K ≈ 100 (≈ 92 % for a
    nominal 95 % in our tests); BCa corrects the median bias (z0) and the skewness (a). A
    statistic with non-finite resamples (a scale of 0) gets [nan, nan].
    """
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0)
    p = point[:, None]
    below = (boot < p).double().mean(1) + 0.5 * (boot == p).double().mean(1)
    z0 = normal.icdf(below.clamp(1e-6, 1 - 1e-6))[:, None]
    d = jackknife.mean(1, keepdim=True) - jackknife
    denom = 6 * d.pow(2).sum(1, keepdim=True).pow(1.5)
    a = torch.where(denom > 0, d.pow(3).sum(1, keepdim=True) / denom.clamp_min(1e-300), 0.0)
    z = normal.icdf(torch.tensor([(1 - confidence) / 2, (1 + confidence) / 2], dtype=torch.float64))
    levels = normal.cdf(z0 + (z0 + z) / (1 - a * (z0 + z)))  # [S, 2]
    # linear-interpolated quantiles with a different level per row
    ordered = boot.sort(1).values
    pos = levels.clamp(0, 1) * (boot.shape[1] - 1)
    lo = pos.floor().long().clamp(max=boot.shape[1] - 1)
    hi = (lo + 1).clamp(max=boot.shape[1] - 1)
    frac = pos - lo
    q = ordered.gather(1, lo) * (1 - frac) + ordered.gather(1, hi) * frac
    bad = ~(torch.isfinite(boot).all(1) & torch.isfinite(jackknife).all(1))
    return q.masked_fill(bad[:, None], float("nan"))


def variance_summary(
    moments: RepeatMoments,
    names: list[str],
    *,
    base: str | None = None,
    num_bootstrap: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict:
    """Per-estimator statistics and ratios against ``base`` with paired bootstrap CIs.

    ``names`` has one entry per estimator (E). Returns a JSON-ready dict::

        {"num_repeats": K, "base": base, "confidence": c,
         "estimators": {name: {"variance", "signal_norm_sq", "signal_scale",
                               "variance_per_signal", and "<stat>_ci" [lo, hi] per stat}},
         "ratios": {"<a>/<base>": {"value", "ci95": [lo, hi]}},            # variance ratio
         "ratios_per_signal": {"<a>/<base>": {"value", "ci95": [lo, hi]}}}

    The bootstrap resamples repeat indices with replacement, the same indices for every
    estimator (paired), and reports BCa intervals (``bca_intervals``); the key is "ci95" at the
    default confidence and "ci" otherwise. With K = 2 the jackknife is undefined and the
    intervals are NaN. ``num_bootstrap=0`` gives point estimates only (no
    Gram matrix needed) and omits the intervals.
    """
    _check_summary_args(moments, names, base, num_bootstrap, confidence)
    num_est, k = moments.norm_sq.shape
    point = _statistics(moments, None)
    stats = list(point)
    b = None if base is None else names.index(base)
    labels = [("estimators", name, stat) for name in names for stat in stats]
    for key, stat in _RATIOS:
        labels += [(key, f"{n}/{base}", stat) for e, n in enumerate(names) if b not in (None, e)]

    def flatten(values: dict[str, Tensor]) -> Tensor:
        """[E, X] per statistic -> [S, X], one row per label (a ratio is row / base row)."""
        rows = [values[stat][e] for e in range(num_est) for stat in stats]
        for _, stat in _RATIOS:
            rows += [
                values[stat][e] / values[stat][b] for e in range(num_est) if b not in (None, e)
            ]
        return torch.stack(rows)

    point_rows = flatten(point)[:, 0].tolist()
    ci_rows = None
    if num_bootstrap > 0:
        boot = flatten(_statistics(moments, _bootstrap_weights(k, num_bootstrap, seed)))
        jack = flatten(_statistics(moments, 1 - torch.eye(k, dtype=torch.float64)))
        ci_rows = bca_intervals(flatten(point)[:, 0], boot, jack, confidence).tolist()

    ci_key = "ci95" if math.isclose(confidence, 0.95) else "ci"
    out: dict = {"num_repeats": k, "base": base, "confidence": confidence, "estimators": {}}
    if base is not None:
        out["ratios"], out["ratios_per_signal"] = {}, {}
    for i, (key, name, stat) in enumerate(labels):
        if key == "estimators":
            row = out["estimators"].setdefault(name, {})
            row[stat] = point_rows[i]
            if ci_rows is not None:
                row[f"{stat}_ci"] = ci_rows[i]
        else:
            out[key][name] = {"value": point_rows[i]}
            if ci_rows is not None:
                out[key][name][ci_key] = ci_rows[i]
    return out


def _check_summary_args(moments, names, base, num_bootstrap, confidence) -> None:
    """``variance_summary``'s arguments against the moments' E estimators and K repeats
    (``ValueError`` naming the argument)."""
    num_est, k = moments.norm_sq.shape
    if list(names) != [str(n) for n in names] or len(names) != num_est:
        raise ValueError(f"names: expected {num_est} estimator names (strings), got {names!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"names: expected distinct names, got {names!r}")
    if base is not None and base not in names:
        raise ValueError(f"base: expected one of {list(names)}, got {base!r}")
    if k < 2:
        raise ValueError(f"moments: expected >= 2 repeats, got {k}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence: expected a value in (0, 1), got {confidence!r}")
    if num_bootstrap < 0 or (num_bootstrap > 0 and moments.gram is None):
        raise ValueError(
            f"num_bootstrap: expected 0 without a Gram matrix or >= 0 with one, got {num_bootstrap}"
        )


def _bootstrap_weights(k: int, num_bootstrap: int, seed: int) -> Tensor:
    """[num_bootstrap, K] float64 repeat weights: how often each of the K repeats is drawn in
    each resample (K draws with replacement, a ``seed``-ed generator; a row sums to K)."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(k, (num_bootstrap, k), generator=gen)
    weights = torch.zeros(num_bootstrap, k, dtype=torch.float64)
    weights.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float64))
    return weights
