"""Exercise 06 — ZeRO-Offload's delayed parameter update, built by hand, and the host's bytes.

Lesson 06 turns on the engine's delayed parameter update (DPU, ZeRO-Offload arXiv 2101.06840,
Sec. 5.2) and measures what it does to speed and to the loss. Here you build it: the host's
optimizer step runs in the background while the device computes the next forward and backward,
and its result reaches the device one step late.

``DelayedOffloadAdam`` is set up for you for one padded flat buffer of parameters on rank r of N
(``zerolab.flat.FlatParams``: the parameters are views into ``self.flat.data``, their ``.grad``
views into ``self.grads``). What lives where:

    device: self.flat.data     full parameters, compute dtype, every rank
            self.grads         full local gradients, laid out like self.flat.data
    host:   self.grad_host     this rank's gradient shard, compute dtype (pinned on a GPU)
            self.master        this rank's parameter shard in fp32 (fp64 for fp64 models)
            self.optimizer     AdamW over [self.master] only: its moments are host, shard-sized

06.1 ``step`` and ``flush``: the order of things, the thread, and what each may touch, are yours.
06.2 ``host_bytes_per_element``: measure what offload keeps on the host, and explain it.

Tools: ``self.flat.shard(buffer)`` (this rank's slice, a view), ``zerolab.comm.reduce_scatter`` /
``zerolab.comm.all_gather`` (output may be the rank's own slice of input), ``threading.Thread``.
Grade your work: ``make grade`` or ``zerolab.grade.check("06")``.
"""
import torch
import torch.distributed as dist

from zerolab.flat import FlatParams, unique_trainable
from zerolab.offload import host_buffer, host_optimizer
from zerolab.shard_optim import master_dtype


class DelayedOffloadAdam:
    """``opt = DelayedOffloadAdam(model.parameters(), lr=1e-3)``; per step ``loss.backward();
    opt.step(); opt.zero_grad()``; ``opt.flush()`` before using the parameters (evaluation, saving).

    Contract (graded on 2 ranks, float64 and bfloat16):

    * ``step()``: this rank's shard of the gradients, averaged over the ranks, goes to the host
      (reduce-scatter, 2Ψ/N); the update the PREVIOUS ``step()`` started is finished and published
      (the fp32 master cast into this rank's shard of ``self.flat.data``, then all-gathered); the host
      update with the new gradient shard is STARTED in a background thread, and ``step()`` returns
      without waiting for it. So the next forward and backward run on parameters one update behind;
    * the background update touches host tensors only: the device gradients may be overwritten as
      soon as ``step()`` returns (the next backward does just that);
    * ``flush()``: finish the running update and publish it (every rank calls it);
    * the optimizer's state is the host master's alone.
    """

    def __init__(self, params, *, lr, param_dtype=None, group=None):
        self.group = group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        params = unique_trainable(params)
        originals = [p.detach().clone() for p in params]            # exact values, before any cast
        self.flat = FlatParams(params, self.world_size, self.rank, dtype=param_dtype)
        self.grads = self.flat.new_buffer()                          # device: full gradients
        for p, g in zip(self.flat.params, self.flat.views(self.grads)):
            p.grad = g
        own = self.flat.shard(self.flat.data)
        self.grad_host = host_buffer(own.numel(), own.dtype, like=own)            # host: 2Ψ/N (bf16)
        self.master = self.flat.shard_from(originals, master_dtype(own.dtype)).cpu()  # host: 4Ψ/N
        self.optimizer, self.fused = host_optimizer([self.master], torch.optim.AdamW, lr=lr)  # host: 8Ψ/N

    def step(self):
        raise NotImplementedError(
            "Exercise 06.1: send this step's gradient shard to the host, publish the previous update, "
            "and start this one in the background (see the class docstring's contract).")

    def flush(self):
        raise NotImplementedError("Exercise 06.1: finish the running update and publish it.")

    def zero_grad(self):
        self.grads.zero_()


def host_bytes_per_element(param_dtype):
    """Build ``zerolab.initialize(models.build("gpt"), stage=2, offload="optimizer", lr=1e-3,
    param_dtype=param_dtype)`` on the current ranks, run one step (``models.batch("gpt",
    seed=rank, model=model)``), and return the bytes of model states this rank keeps on the HOST
    (``engine.placement()``, by role) per parameter element it owns (Ψ/N, padding included).

    Measure it; graded against the grader's own measurement for float32 and bfloat16. Then
    compare it with the paper's (2 + 12) bytes per owned parameter and explain the difference."""
    raise NotImplementedError(
        "Exercise 06.2: the host bytes of model states after a step, per owned element.")
