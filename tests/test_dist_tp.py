"""DTensor tensor parallel (TP = 2) and DP × TP = 2 × 2 vs the single-process Actor."""

from __future__ import annotations

import pytest

from dist_utils import VOCAB, check_ok, launch
from test_dist_engine import _engine_worker, check_against_reference

pytestmark = pytest.mark.distributed

LAYERS = 2  # tiny_llama's decoder blocks


# Tied embeddings (Qwen2-style) and an odd vocabulary: the lm_head and the embedding share one
# [V, H] weight sharded on dim 0, split unevenly (33 + 32 rows).
TIED_ODD = {"vocab_size": VOCAB + 1, "tie_word_embeddings": True}


def test_tp2_matches_actor_without_gathering_the_vocabulary(tmp_path):
    results = check_ok(launch(_engine_worker, 2, tmp_path, "tp", 1, 2, False, 0, TIED_ODD))
    check_against_reference(results, 2, TIED_ODD)
    for rank, shard in ((0, 33), (1, 32)):
        # the statistics saw only this rank's part of the vocabulary
        assert results[rank]["logits_shape"][-1] == shard
        ops = results[rank]["collectives"]
        # per micro-batch forward: embedding + (attention out, MLP out) per block all-reduce
        # their partial sums, and the three statistics take two all-reduces; nothing is
        # gathered (an all_gather of logits would show up as gloo:all_gather)
        micro_batches = 8 // 4
        assert not [op for op in ops if "gather" in op], ops
        assert len(ops) == micro_batches * (1 + 2 * LAYERS + 2), ops


def test_dp2_tp2_four_processes_two_steps(tmp_path):
    results = check_ok(launch(_engine_worker, 4, tmp_path, "tp", 1, 2, True, 1, timeout_s=240.0))
    check_against_reference(results, 4)
    assert all(results[r]["logits_shape"][-1] == VOCAB // 2 for r in range(4))
