"""DDP through the Trainer and FSDP sharding, in two CPU processes (gloo) started by torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distributed_check import FSDP_STEP_ROWS
from tiny_models import SCHEDULES, tiny_model
from trainer_helpers import right_padded, sgd_trainer, trained_parameters

SCRIPT = Path(__file__).with_name("distributed_check.py")


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory) -> Path:
    """One torchrun launch that trains every schedule (starting processes is the slow part)."""
    out = tmp_path_factory.mktemp("distributed")
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT),
         str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return out


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_ddp_and_fsdp_on_two_cpu_processes(two_process_runs, tmp_path, schedule):
    runs = two_process_runs / schedule

    # DDP: the ranks stay in sync and match one process taking the same global batch of 4.
    ranks = [torch.load(runs / f"ddp_rank{r}.pt") for r in range(2)]
    single = trained_parameters(sgd_trainer(
        str(tmp_path / "single"), dtype=torch.float64, max_steps=2, per_device_train_batch_size=4, schedule=schedule))
    initial = dict(tiny_model(seed=1, schedule=schedule).double().named_parameters())
    assert ranks[0].keys() == single.keys()
    for name, expected in single.items():
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        torch.testing.assert_close(ranks[0][name], expected, rtol=1e-10, atol=1e-12, msg=name)
    assert any(not torch.equal(single[name], initial[name]) for name in single)

    # FSDP: the policy wraps exactly the blocks, and a sharded step is the unsharded one.
    fsdp = torch.load(runs / "fsdp.pt")
    assert fsdp["wrapped"] == [f"model.layers.{i}" for i in range(len(SCHEDULES[schedule]))]
    model = tiny_model(seed=1, schedule=schedule).train()
    model(**right_padded(FSDP_STEP_ROWS[0] + FSDP_STEP_ROWS[1])).loss.backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    for name, expected in model.named_parameters():
        torch.testing.assert_close(fsdp["parameters"][name], expected.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_state_passing_under_ddp(two_process_runs):
    # Each rank carries the states of its own rows (they differ), while the ranks' parameters
    # stay in sync and move.
    ranks = [torch.load(two_process_runs / f"state_passing_rank{r}.pt") for r in range(2)]
    for name, parameter in ranks[0]["parameters"].items():
        assert torch.equal(parameter, ranks[1]["parameters"][name]), name
    assert ranks[0]["carried"].keys() == {0, 1, 3}  # the memory layers of the hybrid, not its attention
    assert ranks[0]["carried"][0]["m_k"].shape[0] == 2  # the rank's own two rows
    assert not torch.allclose(ranks[0]["carried"][0]["m_k"], ranks[1]["carried"][0]["m_k"])
