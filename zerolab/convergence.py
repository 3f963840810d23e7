"""Lesson 12's convergence run: TinyGPT trained with stage 3 exact, with qwZ, and with qwZ + qgZ on a
2 x 2 mesh, the loss of every step recorded. A tool above :func:`zerolab.initialize` (it builds
engines), so that :mod:`zerolab.hybrid` stays an engine.

``python -m zerolab.convergence OUT.json [STEPS]`` writes the three runs of :data:`CONVERGENCE_RUNS`
(``notebooks/data/12_convergence.json``, 300 steps); the lesson plots them and re-runs a prefix live.
"""
import json
import sys

import torch
import torch.distributed as dist

from zerolab import models
from zerolab.launch import Cluster
from zerolab.stages import initialize

CONVERGENCE_GPT = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, seq_len=16)
CONVERGENCE_RUNS = {"exact": {}, "qwZ": dict(quantize_weights=True),
                    "qwZ + qgZ (int4)": dict(mesh=(2, 2), hpz=True, quantize_weights=True, quantize_gradients="int4")}


def progression_batch(seed, batch_size=8, vocab_size=64, seq_len=16):
    """A learnable next-token task (random tokens are not: their loss stays at ln V): each sequence
    counts from a random start by a random stride of 1-4, modulo V. The model must read the stride
    from the context: loss falls from ln V toward 0."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab_size, (batch_size, 1), generator=g)
    stride = torch.randint(1, 5, (batch_size, 1), generator=g)
    tokens = (start + stride * torch.arange(seq_len + 1)) % vocab_size
    return tokens[:, :-1], tokens[:, 1:]


def convergence_losses(options, steps, *, lr=3e-3, quantize_block=64):
    """On every rank: TinyGPT (:data:`CONVERGENCE_GPT`) trained with stage 3 and ``options`` for
    ``steps`` steps on :func:`progression_batch`; returns the loss of each step averaged over ranks."""
    model = models.build("gpt", seed=0, **CONVERGENCE_GPT)
    quantized = any(options.get(k) for k in ("quantize_weights", "quantize_gradients"))
    engine = initialize(model, stage=3, lr=lr, **options, **({"quantize_block": quantize_block} if quantized else {}))
    losses = []
    for step in range(steps):
        loss = engine(*progression_batch(1000 * step + dist.get_rank()))
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def write_convergence(path, steps):
    """Run :data:`CONVERGENCE_RUNS` on 4 ranks for ``steps`` steps each; write the losses to ``path``."""
    with Cluster(world_size=4, timeout=600) as cluster:
        runs = {name: cluster.run(convergence_losses, options, steps)[0] for name, options in CONVERGENCE_RUNS.items()}
    with open(path, "w") as f:
        json.dump({"steps": steps, "model": CONVERGENCE_GPT, "runs": CONVERGENCE_RUNS, "losses": runs}, f)
        f.write("\n")


if __name__ == "__main__":
    write_convergence(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 300)
