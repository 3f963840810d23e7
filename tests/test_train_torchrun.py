"""`python -m zerolab.train` under torchrun (env:// rendezvous, the multi-machine path) and inside
zerolab's own ranks: the printed global losses equal one process training on the concatenated
batches. Parametrized over every stage whose module exists."""
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from zerolab import models
from zerolab.train import parse_args, step_batch, train

ARGS = ["--steps", "3", "--batch-size", "4", "--lr", "1e-2", "--model", "gpt"]
STAGES = [0, 1, 2, 3]


def reference_losses(argv, world_size):
    """One process, no communication: AdamW on the world_size batches of each step concatenated."""
    args = parse_args(argv)
    model = models.build(args.model, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        parts = [step_batch(args.model, model, step=step, rank=r, world_size=world_size,
                            seed=args.seed, batch_size=args.batch_size) for r in range(world_size)]
        loss = model(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def torchrun_output():
    """ONE torchrun with 2 ranks trains every available stage in turn (a start costs ~10 s)."""
    stages = [str(s) for s in STAGES]
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "zerolab.train",
                           "--stage", *stages, *ARGS], capture_output=True, text=True, timeout=540, env=env)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", STAGES)
def test_torchrun_two_ranks(torchrun_output, stage):
    printed = [float(m) for m in re.findall(rf"^stage {stage} step \d+ loss ([-\d.]+)", torchrun_output, re.M)]
    expected = reference_losses(ARGS, 2)
    assert len(printed) == len(expected), f"rank 0 printed:\n{torchrun_output}"
    for step, (got, want) in enumerate(zip(printed, expected)):
        assert got == pytest.approx(want, abs=2e-5), f"stage {stage}, step {step}: {got} vs {want}"
    assert f"stage {stage}, 2 ranks: model states on rank 0" in torchrun_output


@pytest.mark.parametrize("stage", STAGES)
def test_train_inside_zerolab_ranks(clusters, stage):
    argv = ["--stage", str(stage), *ARGS]
    per_rank = clusters(2).run(train, parse_args(argv), log=lambda line: None)
    expected = reference_losses(argv, 2)
    for rank, losses in enumerate(per_rank):
        assert losses[stage] == pytest.approx(expected, abs=1e-5), f"rank {rank}: {losses} vs {expected}"


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--stage", "4"], ["--param-dtype", "fp8"]])
def test_bad_arguments_exit_with_usage(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)
