"""Run by tests/test_distributed.py under ``torchrun --nproc_per_node 2`` on CPU (gloo).

    ACCELERATE_USE_CPU=1 torchrun --standalone --nproc_per_node 2 tests/distributed_check.py OUT_DIR

For every layer schedule of ``tiny_models.SCHEDULES`` (one launch for all of them):

1. DDP through the stock Trainer: 2 steps, 2 rows per process (a global batch of 4); every
   rank writes its parameters to ``OUT_DIR/<schedule>/ddp_rank{R}.pt``.
2. FSDP: accelerate's transformer auto-wrap policy (from ``_no_split_modules``) picks the blocks,
   torch's ``fully_shard`` shards them and the root, and one SGD step on rank-specific rows
   runs sharded; rank 0 writes ``OUT_DIR/<schedule>/fsdp.pt`` with the wrapped module names and
   the gathered parameters after the step.
3. State passing under DDP, once (:func:`run_state_passing`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tiny_models import SCHEDULES, tiny_model
from trainer_helpers import ROWS, right_padded, sgd_trainer, trained_parameters

FSDP_STEP_ROWS = (ROWS[:2], ROWS[2:5])  # rank r trains on FSDP_STEP_ROWS[r]: unequal token counts


def run_ddp(out: Path, schedule: str) -> None:
    # float64: the two ranks' half batches round differently from one full batch; in float64 that
    # stays far below the tolerance, so the comparison can be tight.
    trainer = sgd_trainer(
        str(out / "ddp"), dtype=torch.float64, max_steps=2, per_device_train_batch_size=2, schedule=schedule)
    parameters = trained_parameters(trainer)
    assert trainer.args.world_size == 2 and dist.get_backend() == "gloo"
    assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    torch.save(parameters, out / f"ddp_rank{dist.get_rank()}.pt")


def run_fsdp(out: Path, schedule: str) -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from torch.distributed.fsdp import fully_shard

    model = tiny_model(seed=1, schedule=schedule).train()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    wrapped = [name for name, module in model.named_modules() if name and policy(module)]
    for name in wrapped:
        fully_shard(model.get_submodule(name))
    fully_shard(model)

    batch = right_padded(FSDP_STEP_ROWS[dist.get_rank()])
    # The mean over the global batch, as the Trainer computes it: each rank divides its summed
    # loss by the global label count, and FSDP averages gradients over the ranks.
    tokens = torch.tensor(sum(len(r["input_ids"]) - 1 for rows in FSDP_STEP_ROWS for r in rows))
    loss = model(**batch, num_items_in_batch=tokens).loss * dist.get_world_size()
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    gathered = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    if dist.get_rank() == 0:
        torch.save({"wrapped": wrapped, "parameters": gathered}, out / "fsdp.pt")


def run_state_passing(out: Path) -> None:
    """3. DDP with state passing (hybrid): each rank carries its own rows' states; the ranks'
    parameters stay in sync. Writes ``OUT_DIR/state_passing_rank{R}.pt``."""
    from trellis_lm.state_passing import StatePassingCallback

    trainer = sgd_trainer(str(out / "sp"), dtype=torch.float64, max_steps=2, per_device_train_batch_size=2,
                          schedule="hybrid")
    callback = StatePassingCallback(probability=1.0)
    trainer.add_callback(callback)
    parameters = trained_parameters(trainer)
    carried = {index: state.tensors() for index, (_, _, state) in callback.passing.carried.items()}
    torch.save({"parameters": parameters, "carried": carried}, out / f"state_passing_rank{dist.get_rank()}.pt")


def main() -> None:
    for schedule in SCHEDULES:
        out = Path(sys.argv[1]) / schedule
        out.mkdir(parents=True, exist_ok=True)
        run_ddp(out, schedule)  # the first Trainer sets up the gloo process group
        run_fsdp(out, schedule)
        dist.barrier()
    run_state_passing(Path(sys.argv[1]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
