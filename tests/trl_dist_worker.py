"""One rank of the 2-process OTBGRPOTrainer test (launched by torch.distributed.run, gloo on
CPU): 6 rows per rank, groups of 4, so the second group straddles the ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import trl_helpers as H

torch.set_num_threads(1)
model_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
trainer = H.trainer(model_dir, out_dir, per_device_train_batch_size=6, max_steps=3)
trainer.train()
rank = trainer.accelerator.process_index
records = [{k: v for k, v in rec.items() if k != "plugin"} for rec in trainer.records]
torch.save(records, out_dir / f"rank{rank}.pt")
# An explicit teardown: left to interpreter exit, gloo's threads were once destroyed while
# still joinable ("terminate called without an active exception", SIGABRT after the last step)
if torch.distributed.is_initialized():
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
