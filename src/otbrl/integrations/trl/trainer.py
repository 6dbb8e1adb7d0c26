"""``OTBGRPOTrainer``: TRL's ``GRPOTrainer`` with per-token Optimal Token Baseline advantages.

TRL computes one advantage per sequence inline in ``_generate_and_score_completions`` and
has no hook for another estimator, so this subclass overrides that method: it lets TRL
generate and score, then replaces ``advantages`` by ``[B, T]`` OTB advantages from
``otbrl.algos.compute_advantage`` over the whole gathered generation batch.
``_compute_loss`` takes ``[B, T]`` advantages as they are.

Σπ² comes from TRL's own fused lm_head (``log_sum_sq_probs``, computed in the same tiled pass
as the log-probs). The trainer adds a second fused head that also asks for that field and
routes to it only the policy forward that computes the old log-probs, so the training forward
pays nothing. When TRL runs that forward anyway (gradient accumulation misaligned with
generation, or vLLM IS correction) Σπ² comes with it; otherwise the trainer runs that one
no-grad forward itself (metric ``otb/extra_forward`` = 1).
"""

from __future__ import annotations

import functools
import types
import weakref

import torch
from accelerate.utils import is_peft_model
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import add_fused_lm_head

from otbrl.algos import ESTIMATORS, compute_advantage, get_estimator
from otbrl.algos.metrics import otb_metrics
from otbrl.integrations.trl.batch import gather_padded, group_index, token_level_rewards
from otbrl.integrations.trl.config import OTBGRPOConfig


class OTBGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose advantages are per-token OTB (or TIR-OTB) advantages.

    Same arguments as ``GRPOTrainer``; ``args`` must be an :class:`OTBGRPOConfig`. After each
    generation batch, ``last_otb_batch`` holds the gathered inputs and outputs of the
    estimator (``token_level_rewards``, ``response_mask``, ``index``, ``old_log_probs``,
    ``sum_pi_squared``, ``rollout_is_weights``, ``advantages``, each ``[N, T_max]`` or
    ``[N]``; ``estimator``; ``extra_forward``).
    """

    def __init__(self, model, reward_funcs, args: OTBGRPOConfig | None = None, **kwargs):
        if not isinstance(args, OTBGRPOConfig):
            raise TypeError(
                f"args: expected an OTBGRPOConfig, got {type(args).__name__} "
                "(from otbrl.integrations.trl import OTBGRPOConfig)"
            )
        super().__init__(model, reward_funcs, args=args, **kwargs)
        if self._is_vlm:
            raise ValueError(
                "model: OTBGRPOTrainer covers text models; vision-language models are not "
                "supported (their extra forward inputs are not carried)"
            )
        # OTB and TIR-OTB need the same statistics, so "auto" can be decided per batch.
        name = "optimal_token_baseline" if args.otb_estimator == "auto" else args.otb_estimator
        self._otb_needs = ESTIMATORS[name].needs_for(**args.otb_options)
        self._otb_sink: list | None = None  # log Σπ² chunks of the forward being captured
        self._otb_arm = False  # capture the next policy forward
        self._otb_spp = None
        self._otb_rewards = None
        self.last_otb_batch: dict | None = None
        if "sum_pi_squared" in self._otb_needs:
            self._add_sum_pi_squared_head()

    def _add_sum_pi_squared_head(self) -> None:
        base = self.model.get_base_model() if is_peft_model(self.model) else self.model
        trl_forward = base.forward  # TRL's fused head (log-probs, entropy)
        add_fused_lm_head(
            base,
            temperature=self.temperature,
            cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32,
            outputs=("log_probs", "entropy", "log_sum_sq_probs"),
        )
        spp_forward = base.forward
        trainer = weakref.ref(self)

        # Keep the model's signature: generate() validates its kwargs against it.
        @functools.wraps(type(base).forward)
        def forward(module, *args, **kwargs):
            owner = trainer()
            sink = None if owner is None else owner._otb_sink
            if sink is None or not kwargs.get("fused_lm_head"):
                return trl_forward(*args, **kwargs)
            out = spp_forward(*args, **kwargs)
            sink.append(out.log_sum_sq_probs)
            return out

        base.forward = types.MethodType(forward, base)

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, *a, **kw
    ):
        if not self._otb_arm or model is self.ref_model:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *a, **kw
            )
        # Only the first policy forward of a generation batch is the old-log-prob one (TRL
        # runs the reference forward after it).
        self._otb_arm, self._otb_sink = False, []
        try:
            out = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *a, **kw
            )
        finally:
            chunks, self._otb_sink = self._otb_sink, None
        spp = torch.cat([c[:, -logits_to_keep:] for c in chunks]).float().exp()
        self._otb_spp = spp if spp.shape == out[0].shape else None
        return out

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # [N, n_funcs], already gathered over processes by TRL.
        self._otb_rewards = super()._calculate_rewards(
            inputs, prompts, completions, completion_ids_list
        )
        return self._otb_rewards

    def _trl_runs_old_forward(self) -> bool:
        # The condition under which TRL's _generate_and_score_completions computes
        # old_per_token_logps (checked against its output below).
        generate_every = self.args.steps_per_generation * self.num_iterations
        return bool(
            self.args.gradient_accumulation_steps % generate_every != 0
            or (self.use_vllm and self.vllm_importance_sampling_correction)
        )

    def _generate_and_score_completions(self, inputs):
        want_stats = bool(self._otb_needs & {"old_log_probs", "sum_pi_squared"})
        self._otb_spp = self._otb_rewards = None
        self._otb_arm = want_stats and self._trl_runs_old_forward()
        try:
            out = super()._generate_and_score_completions(inputs)
        finally:
            self._otb_arm = False
        old_lp, spp, extra = out.get("old_per_token_logps"), self._otb_spp, 0.0
        if want_stats and (old_lp is None or spp is None):
            lp, spp = self._old_log_probs_and_sum_pi_squared(out)
            old_lp, extra = (lp if old_lp is None else old_lp), 1.0
        out["advantages"] = self._otb_advantages(out, old_lp, spp, extra)
        return out

    def _old_log_probs_and_sum_pi_squared(self, out):
        """The one no-grad forward of the policy, when TRL did not run it: ``[b, T]`` each."""
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        mode = "train" if self.model.training else "eval"
        batch_size = (
            self.args.per_device_train_batch_size
            if mode == "train"
            else self.args.per_device_eval_batch_size
        )
        self._otb_arm = True
        try:
            with (
                torch.no_grad(),
                disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
            ):
                lp, _, _ = self._get_per_token_logps_and_entropies(
                    self.model, ids, mask, out["completion_ids"].size(1), batch_size=batch_size
                )
        finally:
            self._otb_arm = False
        if self._otb_spp is None:
            raise RuntimeError("OTBGRPOTrainer: the policy forward returned no Σπ²")
        return lp, self._otb_spp

    def _otb_advantages(self, out, old_lp, spp, extra_forward: float):
        """``[b, T]`` OTB advantages of this rank's rows, computed over the gathered batch."""
        acc = self.accelerator
        mode = "train" if self.model.training else "eval"
        mask = out["completion_mask"].float()
        tool_mask = out.get("tool_mask")
        if tool_mask is not None:
            mask = mask * tool_mask.float()
        b, T = mask.shape
        isw = None
        if self.args.otb_use_vllm_is_weights:
            isw = out["importance_sampling_ratio"].float().expand(b, T)  # [b, 1] when per sequence
        fields = [mask] + [x for x in (old_lp, spp, isw) if x is not None]
        gathered = gather_padded(
            fields, lambda x: acc.pad_across_processes(x, dim=2, pad_index=0), acc.gather
        )
        g_mask, rest = gathered[0], iter(gathered[1:])
        g_old = next(rest) if old_lp is not None else None
        g_spp = next(rest) if spp is not None else None
        g_isw = next(rest) if isw is not None else None

        per_func = self._otb_rewards
        rewards = (per_func * self.reward_weights.to(per_func.device)[None]).nansum(dim=1)
        unscorable = torch.isnan(per_func).all(dim=1)
        rewards = torch.where(unscorable, 0.0, rewards).to(g_mask.device)
        N = g_mask.shape[0]
        n_gen = self.num_generations if mode == "train" else self.num_generations_eval
        index = group_index(N, n_gen, unscorable).to(g_mask.device)
        name = self.args.otb_estimator
        if name == "auto":
            name = (
                "tir_optimal_token_baseline" if tool_mask is not None else "optimal_token_baseline"
            )
        r = token_level_rewards(rewards, g_mask)
        advantages, _ = compute_advantage(
            name,
            token_level_rewards=r,
            response_mask=g_mask,
            index=index,
            old_log_probs=g_old,
            sum_pi_squared=g_spp,
            rollout_is_weights=g_isw,
            **self.args.otb_options,
        )
        self._log_otb(mode, name, advantages, g_mask, index, g_old, g_spp, g_isw, extra_forward)
        self.last_otb_batch = {
            "token_level_rewards": r,
            "response_mask": g_mask,
            "index": index,
            "old_log_probs": g_old,
            "sum_pi_squared": g_spp,
            "rollout_is_weights": g_isw,
            "advantages": advantages,
            "estimator": name,
            "extra_forward": extra_forward,
        }
        rank = acc.process_index
        return advantages[rank * b : (rank + 1) * b, :T].contiguous()

    def _log_otb(self, mode, name, adv, mask, index, old_lp, spp, isw, extra_forward):
        metrics = self._metrics[mode]
        space = get_estimator(name).response_space
        for key, value in otb_metrics(
            adv, mask, index, old_lp, spp, rollout_is_weights=isw, response_space=space
        ).items():
            metrics[key].append(float(value))
        metrics["otb/extra_forward"].append(extra_forward)
        if spp is not None:
            metrics["otb/sum_pi_squared/mean"].append(
                float((spp * mask).sum() / mask.sum().clamp(min=1))
            )
        # TRL's completions table shows one advantage per row: the row's mean OTB advantage.
        row_mean = (adv * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        logged = self._logs["advantages"]
        if len(logged) >= len(row_mean):
            for _ in range(len(row_mean)):
                logged.pop()
            logged.extend(row_mean.tolist())
