"""``otbrl variance``: empirical policy-gradient variance of several advantage estimators.

For a fixed policy and a fixed set of P prompts, each of K repeats samples N responses per
prompt once, runs one forward (log-probs with their graph, Σπ², entropy), computes every
estimator's advantages on those same samples and takes the parameter gradient of the configured
policy loss at ratio = 1 for each (``otbrl.research.gradient_probe``: one vector-Jacobian
product per estimator on one graph). The statistics (variance, signal scale along an unbiased
high-sample RLOO reference, paired bootstrap CIs) live in ``otbrl.research.gradient_variance``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable

import torch
from torch import Tensor

from otbrl.models import eos_token_ids
from otbrl.research.gradient_probe import EstimatorSpec, GradientProbe, parse_estimators
from otbrl.research.gradient_variance import GradientVarianceAccumulator, variance_summary
from otbrl.rollout import HFRollout
from otbrl.run.build import build_sampler, load_policy, model_path, policy_loss, scoring
from otbrl.run.seeds import seed_everything, step_seed
from otbrl.store.files import atomic_write_text
from otbrl.store.plain import json_safe

DEFAULT_ESTIMATORS = "grpo,drgrpo,rloo,otb,otb_notail"
# exact Gram matrices keep E·K·P float32 gradients; above this the CountSketch takes over
EXACT_GRAM_BYTES = 1 << 30
DEFAULT_SKETCH_DIM = 8192


def pearson(x: list[float], y: list[float]) -> float:
    """Pearson correlation of two equal-length lists (nan when either is constant)."""
    a, b = torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
    a, b = a - a.mean(), b - b.mean()
    denom = (a.norm() * b.norm()).item()
    return (a @ b).item() / denom if denom > 0 else float("nan")


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman rank correlation (no tie correction: values here are continuous)."""

    def ranks(v):
        return torch.tensor(v).argsort().argsort().double().tolist()

    return pearson(ranks(x), ranks(y))


def measure(
    probe: GradientProbe,
    rows: list[dict],
    specs: list[EstimatorSpec],
    *,
    n: int,
    repeats: int,
    reference: Tensor,
    base: str | None,
    num_bootstrap: int = 2000,
    sketch_dim: int | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Run ``repeats`` repeats at group size ``n``; returns the ``variance_summary`` dict plus
    ``zero_tail_token_share``, ``variance_proxy`` (mean online ``total_power`` per estimator),
    ``variance_proxy_per_sample`` (that divided by the P·n responses of a repeat: the variance
    of a batch mean falls with the batch size, the power does not), ``proxy_calibration``
    (measured variance / per-sample proxy) and the per-repeat correlation of the proxy with the
    measured deviation ‖g_k − ḡ‖² (``proxy_repeat_correlation``)."""
    acc = GradientVarianceAccumulator(len(specs), reference, sketch_dim=sketch_dim, seed=seed)
    power = {s.label: [] for s in specs}
    tail = tokens = 0.0
    start = time.perf_counter()
    for k in range(repeats):
        batch = probe.sample(rows, n, seed=step_seed(seed, n * 10_007 + k))
        grads, extras = probe.gradients(batch, specs)
        acc.add(grads)
        for label, value in extras["power"].items():
            power[label].append(value)
        tail += extras["tail_tokens"]
        tokens += extras["tokens"]
        if progress is not None and ((k + 1) % max(1, repeats // 10) == 0 or k + 1 == repeats):
            progress(f"n={n}: {k + 1}/{repeats} repeats, {time.perf_counter() - start:.0f} s")
    moments = acc.moments()
    labels = [s.label for s in specs]
    out = variance_summary(moments, labels, base=base, num_bootstrap=num_bootstrap, seed=seed)
    out["n"] = n
    out["zero_tail_token_share"] = tail / max(tokens, 1.0)
    out["variance_proxy"] = {label: sum(v) / len(v) for label, v in power.items()}
    batch_size = len(rows) * n
    per_sample = {label: v / batch_size for label, v in out["variance_proxy"].items()}
    out["variance_proxy_per_sample"] = per_sample
    out["proxy_calibration"] = {
        label: out["estimators"][label]["variance"] / max(per_sample[label], 1e-30)
        for label in labels
    }
    # per-repeat squared deviation from the mean gradient, from the Gram matrix
    gram = moments.gram
    deviation = (
        gram.diagonal(dim1=1, dim2=2) - 2 * gram.mean(2) + gram.mean((1, 2))[:, None]
    ).tolist()
    out["proxy_repeat_correlation"] = {
        label: pearson(power[label], deviation[e]) for e, label in enumerate(labels)
    }
    out["seconds"] = time.perf_counter() - start
    return out


def proxy_correlation(results: dict) -> dict:
    """Across all (estimator, n) points: Pearson and Spearman correlation of the per-sample
    online proxy with the measured variance (``*_raw``: of the undivided total power)."""
    proxy, raw, measured = [], [], []
    for res in results.values():
        for label, row in res["estimators"].items():
            proxy.append(res["variance_proxy_per_sample"][label])
            raw.append(res["variance_proxy"][label])
            measured.append(row["variance"])
    return {
        "points": len(proxy),
        "pearson": pearson(proxy, measured),
        "spearman": spearman(proxy, measured),
        "pearson_raw": pearson(raw, measured),
        "spearman_raw": spearman(raw, measured),
    }


def choose_sketch_dim(num_estimators: int, repeats: int, num_params: int, requested) -> int | None:
    """``requested`` None -> exact when E·K·P float32 fit in ``EXACT_GRAM_BYTES``, else the
    default sketch; 0 -> exact; D > 0 -> sketch of dimension D."""
    if requested is None:
        exact_bytes = 4 * num_estimators * repeats * num_params
        return None if exact_bytes <= EXACT_GRAM_BYTES else DEFAULT_SKETCH_DIM
    if requested < 0:
        raise ValueError(f"sketch_dim: expected None or an int >= 0, got {requested}")
    return None if requested == 0 else requested


# -- the command ---------------------------------------------------------------------------------
def format_table(result: dict) -> str:
    """Console table: one block per group size, one line per estimator."""
    lines = []
    base = result["base"]
    for res in result["results"].values():
        lines.append(
            f"n={res['n']}  K={res['num_repeats']}  zero-tail token share "
            f"{res['zero_tail_token_share']:.3f}  ({res['seconds']:.0f} s)"
        )
        lines.append(
            f"  {'estimator':<28}{'variance':>11}{'scale':>11}{'var/scale²':>12}"
            f"  {'variance / ' + str(base) + ' [95% CI]':<30}{'per signal [95% CI]':<28}"
        )
        for label, row in res["estimators"].items():
            text = (
                f"  {label:<28}{row['variance']:>11.4g}{row['signal_scale']:>11.4g}"
                f"{row['variance_per_signal']:>12.4g}"
            )
            pair = f"{label}/{base}"
            for key in ("ratios", "ratios_per_signal"):
                ratio = res.get(key, {}).get(pair)
                cell = "(base)" if label == base else ""
                if ratio is not None:
                    cell = f"{ratio['value']:.3f} {_interval(ratio, res['num_repeats'])}"
                text += f"  {cell:<28}"
            lines.append(text.rstrip())
    corr = result.get("proxy_correlation")
    if corr:
        lines.append(
            f"online proxy vs measured variance over {corr['points']} points: "
            f"pearson {corr['pearson']:.3f}, spearman {corr['spearman']:.3f}"
        )
    return "\n".join(lines)


def _num(value, spec: str) -> str:
    """A number for a table cell; missing or non-finite (JSON null) -> "n/a"."""
    if value is None or not math.isfinite(value):
        return "n/a"
    return format(value, spec)


def _interval(ratio: dict, repeats: int) -> str:
    """A ratio's 95 % interval, ``[lo, hi]``; or a dash and why there is none: no bootstrap,
    K = 2 (a leave-one-out resample holds one repeat: no variance, so BCa has no
    acceleration), or resamples whose base variance or scale is 0 (few repeats)."""
    lo, hi = ratio.get("ci95", ratio.get("ci")) or (None, None)
    if "ci95" not in ratio and "ci" not in ratio:
        return "— (no interval: --bootstrap=0)"
    if all(isinstance(v, int | float) and math.isfinite(v) for v in (lo, hi)):
        return f"[{lo:.3f}, {hi:.3f}]"
    if repeats < 3:
        return "— (no interval: needs --repeats ≥ 3)"
    return "— (no interval: some resamples have a zero base variance or scale; more --repeats)"


def markdown_tables(result: dict) -> str:
    """The measurement as markdown: one table per group size (as in the docs), then the
    proxy correlation. ``proxy calibration`` = variance ÷ (online proxy per response)."""
    base = result["base"]
    blocks = []
    for res in result["results"].values():
        lines = [
            f"**N = {res['n']}** (K = {res['num_repeats']}, zero-tail token share "
            f"{res['zero_tail_token_share']:.3f}, {res['seconds']:.0f} s)",
            "",
            f"| estimator | variance | signal scale | variance / scale² | variance ÷ {base} "
            f"[95 % CI] | per signal ÷ {base} [95 % CI] | proxy calibration "
            "| proxy–deviation corr. |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for label, row in res["estimators"].items():
            cells = [label] + [
                _num(row.get(key), ".4g")
                for key in ("variance", "signal_scale", "variance_per_signal")
            ]
            for key in ("ratios", "ratios_per_signal"):
                ratio = res.get(key, {}).get(f"{label}/{base}")
                if label == base or ratio is None:
                    cells.append("(base)" if label == base else "")
                else:
                    interval = _interval(ratio, res["num_repeats"])
                    cells.append(f"{_num(ratio['value'], '.3f')} {interval}")
            cells.append(_num(res.get("proxy_calibration", {}).get(label), ".3g"))
            cells.append(_num(res.get("proxy_repeat_correlation", {}).get(label), ".2f"))
            lines.append("| " + " | ".join(cells) + " |")
        blocks.append("\n".join(lines))
    corr = result.get("proxy_correlation")
    if corr:
        blocks.append(
            f"Online proxy per response vs measured variance over {corr['points']} points: "
            f"Pearson {_num(corr.get('pearson'), '.3f')}, Spearman "
            f"{_num(corr.get('spearman'), '.3f')} (raw proxy: "
            f"{_num(corr.get('pearson_raw'), '.3f')}, {_num(corr.get('spearman_raw'), '.3f')})."
        )
    return "\n\n".join(blocks) + "\n"


def plot_variance(result: dict, out_png) -> None:
    """Bar chart per group size: variance and variance-per-signal ratios to the base, 95 % CIs."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = list(result["results"].values())
    fig = Figure(figsize=(6 * len(runs), 4), constrained_layout=True)
    FigureCanvasAgg(fig)
    base = result["base"]
    for i, res in enumerate(runs):
        ax = fig.add_subplot(1, len(runs), i + 1)
        pairs = list(res.get("ratios", {}))
        for j, (key, name) in enumerate(
            (("ratios", "variance"), ("ratios_per_signal", "per signal"))
        ):
            values = [res[key][p]["value"] for p in pairs]
            cis = [res[key][p].get("ci95", [v, v]) for p, v in zip(pairs, values)]
            err = [[v - c[0] for v, c in zip(values, cis)], [c[1] - v for v, c in zip(values, cis)]]
            x = [k + 0.4 * j for k in range(len(pairs))]
            ax.bar(x, values, width=0.4, yerr=err, capsize=3, label=name)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([k + 0.2 for k in range(len(pairs))])
        ax.set_xticklabels([p.split("/")[0] for p in pairs], rotation=20, fontsize=8)
        ax.set_title(f"n={res['n']}: ratio to {base} (95% CI)")
        ax.legend(fontsize=8)
    fig.savefig(out_png, dpi=110)


def check_variance_args(
    estimators: str, ns: list[int], repeats: int, prompts: int, reference_samples: int, base
) -> list[EstimatorSpec]:
    """Validate the command's arguments (``ValueError`` naming the argument); returns specs."""
    specs = parse_estimators(estimators)
    labels = [s.label for s in specs]
    if base is not None and base not in labels:
        raise ValueError(f"base: expected one of the estimators {labels}, got {base!r}")
    if repeats < 2:
        raise ValueError(f"repeats: expected >= 2, got {repeats}")
    if prompts < 1:
        raise ValueError(f"prompts: expected >= 1, got {prompts}")
    if reference_samples < 2:
        raise ValueError(f"reference_samples: expected >= 2, got {reference_samples}")
    if not ns or any(n < 2 for n in ns):
        raise ValueError(f"n: expected group sizes >= 2, got {ns}")
    return specs


def run_variance(
    plan,
    *,
    estimators: str = DEFAULT_ESTIMATORS,
    ns: list[int],
    repeats: int,
    prompts: int,
    reference_samples: int,
    base: str | None,
    out: str,
    num_bootstrap: int = 2000,
    sketch_dim: int | None = None,
    method: str = "loop",
    seed: int = 0,
    echo: Callable[[str], None] = print,
) -> dict:
    """``otbrl variance``: measure, print the table, write ``out`` (JSON) and a PNG beside it.

    ``plan``: the run's ``Plan`` (``otbrl.run.plan.plan_run``: the trainer's decisions in
    ``plan.spec`` — its model, sampling parameters, estimator options and loss —, its
    tokenizer, data rows, tools and reward), so the probe samples and scores as the trainer
    would. Returns the result dict written to ``out``.
    """
    specs = check_variance_args(estimators, ns, repeats, prompts, reference_samples, base)
    labels = [s.label for s in specs]
    start = time.perf_counter()
    seed_everything(seed)
    path = model_path(plan.spec.model)
    model = load_policy(plan.spec, path, plan.tokenizer)
    rows = _probe_rows(plan.train_rows, prompts, seed)
    probe = _probe(plan, model, path, method)
    sketch = choose_sketch_dim(len(specs), repeats, probe.num_params, sketch_dim)
    echo(
        f"otbrl variance: {path}, {probe.num_params} parameters, {prompts} prompts, "
        f"K={repeats}, n={ns}, estimators={labels}, Gram "
        f"{'exact' if sketch is None else f'CountSketch D={sketch}'}"
    )
    reference = _reference_gradient(probe, rows, reference_samples, seed, echo)
    results = {}
    for n in ns:
        results[str(n)] = measure(
            probe,
            rows,
            specs,
            n=n,
            repeats=repeats,
            reference=reference.float(),
            base=base,
            num_bootstrap=num_bootstrap,
            sketch_dim=sketch,
            seed=seed,
            progress=echo,
        )
    result = {
        "model": str(path),
        "num_params": probe.num_params,
        "prompts": prompts,
        "repeats": repeats,
        "reference_samples": reference_samples,
        "base": base,
        "estimators": {s.label: {"name": s.name, "options": s.options} for s in specs},
        "gram": "exact" if sketch is None else f"countsketch-{sketch}",
        "results": results,
        "proxy_correlation": proxy_correlation(results),
        "seconds": time.perf_counter() - start,
    }
    echo(format_table(result))
    _write_outputs(result, out, echo)
    return result


def _probe_rows(train_rows: list[dict], prompts: int, seed: int) -> list[dict]:
    """``prompts`` training rows drawn without replacement (a ``seed``-ed permutation)."""
    if len(train_rows) < prompts:
        raise ValueError(f"prompts: expected <= {len(train_rows)} (the data size), got {prompts}")
    order = torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(seed))
    return [train_rows[i] for i in order[:prompts].tolist()]


def _probe(plan, model, path, method: str) -> GradientProbe:
    """The gradient probe of ``model``, sampling, scoring and building the loss as the trainer
    would: its sampling parameters and estimator options (``plan.spec``), its sampler, its
    policy loss without regularizers, its reward scoring."""
    spec, tokenizer = plan.spec, plan.tokenizer
    # the trainer's sampler: the agent loop over the HF backend when tools are configured
    backend = HFRollout(model, tokenizer)
    sampler = build_sampler(
        spec, plan.tools, backend, tokenizer, eos_token_ids(model, tokenizer), str(path), plan.env
    )
    return GradientProbe(
        model,
        tokenizer,
        params=spec.sampling,
        options=dict(spec.estimator_options),
        loss_fn=policy_loss(spec, regularizers=False),
        scoring=scoring(plan),  # the trainer's (no pool: one process)
        method=method,
        sampler=sampler,
    )


class MeasurementError(ValueError):
    """The policy and data give nothing to measure (every sampled group scored alike)."""


def _reference_gradient(probe, rows, reference_samples: int, seed: int, echo) -> torch.Tensor:
    """The RLOO reference gradient [P] float64 (P: the probe's parameters) from
    ``reference_samples`` samples per row (sampled 64 at a time at most); ``MeasurementError``
    when it is zero or not finite (the variances would be measured around nothing)."""
    ref_start = time.perf_counter()
    chunk = min(reference_samples, 64)
    reference = probe.reference(rows, reference_samples, chunk, seed=seed + 99_991)
    if not torch.isfinite(reference).all() or reference.norm() == 0:
        raise MeasurementError(
            "reference: the RLOO reference gradient is zero or not finite (every sampled group "
            "had equal rewards?); use a stronger policy, more --reference-samples or a reward "
            "that varies"
        )
    ref_seconds = time.perf_counter() - ref_start
    echo(f"reference: RLOO, {reference_samples} samples/prompt, {ref_seconds:.0f} s")
    return reference


def _write_outputs(result: dict, out: str, echo) -> None:
    """``result`` as JSON to ``out``, its markdown tables (``.md``) and plot (``.png``)
    beside it."""
    from pathlib import Path

    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_path, json.dumps(json_safe(result), indent=2) + "\n")
    atomic_write_text(out_path.with_suffix(".md"), markdown_tables(result))
    png = out_path.with_suffix(".png")
    plot_variance(result, png)
    echo(
        f"wrote {out_path}, {png} and the markdown tables {out_path.with_suffix('.md')}; "
        f"total {result['seconds']:.0f} s"
    )
