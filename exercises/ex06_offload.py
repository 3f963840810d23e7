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

06.1 ``step`` and ``flush``: the design is yours: which collectives, in what order, what the thread
     does and what it may read, what must be copied and when. The class docstring says what is graded.
06.2 ``host_bytes_per_element``: measure what offload keeps on the host, and explain it.

Tools: ``self.flat.shard(buffer)`` (this rank's slice of a buffer laid out like ``self.flat.data``,
a view), ``zerolab.comm`` (collectives that take an explicit group), ``threading``.
Grade your work: ``make grade`` or ``zerolab.grade.check("06")``.
"""
import torch
import torch.distributed as dist

from zerolab.flat import FlatParams, unique_trainable
from zerolab.offload import host_buffer, host_optimizer
from zerolab.shard_optim import master_dtype


class DelayedOffloadAdam:
    """``opt = DelayedOffloadAdam(model.parameters(), lr=1e-3, group=None)``; per step
    ``loss.backward(); opt.step(); opt.zero_grad()``; ``opt.flush()`` before using the parameters
    (evaluation, saving).

    Contract (graded on 3 ranks in float64 with a model that 3 does not divide, on 2 ranks in
    bfloat16, and on two groups of 2 ranks training side by side; each rule below is measured):

    * one update behind: the forward and backward after the k-th ``step()`` run on the parameters
      updated (AdamW on the host master) with the first k-1 gradients, each averaged over the
      group's ranks; after ``flush()`` on all k. The values of one process doing the same on the
      group's batches, to rounding;
    * overlap: ``step()`` returns before the host update it starts has run; that update runs in the
      background while the next forward and backward compute (graded: it can finish only after the
      next backward has begun);
    * the device's gradients may be overwritten as soon as ``step()`` returns;
    * traffic: a step sends no more, per rank, than the bytes of ZeRO-Offload's two ring collectives
      over the padded buffer in the compute dtype, 2(N-1)/N of it; ``flush()`` no more than half that;
    * placement: the fp32 master (fp64 for fp64 models) and the optimizer's state stay on the host,
      the optimizer holds state for ``self.master`` alone, and after ``flush()`` the device's
      parameters are exactly all the ranks' masters cast to the compute dtype;
    * ``group``: only the group's ranks take part, and another group may train beside it.
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
        raise NotImplementedError("Exercise 06.1: step is not written yet (the class docstring states its contract).")

    def flush(self):
        raise NotImplementedError("Exercise 06.1: finish the running update and publish it.")

    def zero_grad(self):
        self.grads.zero_()


def host_bytes_per_element(param_dtype):
    """The bytes of model states this rank keeps on the HOST per parameter element it owns (Ψ/N,
    padding included; every buffer the host keeps for the update counts, a workspace too), in zerolab's stage 2 with ``offload="optimizer"`` (default buckets) training
    TinyGPT (``models.build("gpt")``) in ``param_dtype`` on the current ranks, after its first step.

    Measure it; graded against the grader's own measurement for float32 and bfloat16. Then
    compare it with the paper's (2 + 12) bytes per owned parameter and explain the difference."""
    raise NotImplementedError(
        "Exercise 06.2: the host bytes of model states after a step, per owned element.")
