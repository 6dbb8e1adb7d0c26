#!/usr/bin/env bash
# Issue 36's study: does OTB at N = 4 match a group mean at N = 32 on long responses?
# chain_sum (46-135-token responses, every step checked), warm start at greedy accuracy 0.454,
# 6 arms x 3 seeds at an equal budget of sampled responses, 32 prompts per step, 2 optimizer
# steps per RL step, lr 1e-4 (3e-4 collapsed both OTB and GRPO after a first rise: measured).
#
# Resumable: run it again with the same settings and finished runs are reused, unfinished
# ones resume from their last checkpoint (trainer.save_every); interrupt it with Ctrl-C or
# SIGTERM (its training runs stop with it: they hold a parent-death signal).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/study-chain-sum}
exec .venv/bin/otbrl compare data.task=chain_sum \
    --arms optimal_token_baseline:4,grpo:4,drgrpo:4,grpo:16,grpo:32,otb_uniform:4 \
    --seeds 3 --budget 8192 --prompts 32 --target 0.85 --base grpo:32 --jobs 2 \
    --out-dir "$OUT" \
    actor.lr=1e-4 data.val_size=200 trainer.save_every=4 trainer.keep_last_checkpoints=1 "$@"
