"""Stage 0 of ``zerolab.initialize``: data parallelism, a full replica of everything on every rank
(DeepSpeed calls it ZeRO stage 0: ZeRO off). The baseline every ZeRO stage is measured against.

Per rank, Ψ trainable parameters, Adam: fp32 training holds params 4Ψ + grads 4Ψ + moments 8Ψ;
``param_dtype=torch.bfloat16`` holds 2Ψ + 2Ψ + fp32 master 4Ψ + moments 8Ψ; both 16Ψ, the
(2 + 2 + K)Ψ baseline of the ZeRO paper (Sec. 3.1, K = 12), N times over. The gradient averaging is
:class:`zerolab.data_parallel.DataParallel` (``bucket_bytes=None``: the naive per-gradient sync).

The same precision rule as the ZeRO stages: parameters computed in a 2-byte type (bf16, fp16,
whether by ``param_dtype`` or because the model was built so) get fp32 master copies that the
optimizer steps; fp32 and fp64 parameters are their own masters.
"""
import torch

from zerolab import comm
from zerolab.data_parallel import DataParallel, broadcast_module
from zerolab.engine import Engine, OwnedGrads, Slot, cast_floats
from zerolab.flat import unique_trainable
from zerolab.shard_optim import master_dtype


class DataParallelEngine(Engine):
    """Stage 0. ``backward`` returns with averaged gradients (as torch DDP's backward does)."""

    stage = 0

    def __init__(self, module, **common):
        super().__init__(module, **common)
        broadcast_module(module, group=self.group)      # every rank starts from rank 0's weights
        self.trainable = unique_trainable(module.parameters())
        dtype = self.param_dtype or self.trainable[0].dtype
        self.reduce_dtype = self.reduce_dtype or dtype     # gradients are all-reduced in it
        self.masters = None
        if master_dtype(dtype) != dtype:
            # Mixed precision: fp32 master weights (4Ψ) taken BEFORE the cast, so nothing is lost;
            # the model computes in 2-byte params and grads (2Ψ + 2Ψ).
            self.masters = [p.detach().to(master_dtype(dtype)).clone() for p in self.trainable]
        if self.param_dtype is not None:
            module.to(self.param_dtype)
        self.ddp = DataParallel(module, bucket_bytes=self.bucket_bytes, group=self.group, broadcast=False,
                                reduce_dtype=self.reduce_dtype)
        self.optimizer = self.optimizer_class(self.masters or self.trainable, **self.opt_kwargs)

    def forward(self, *args, **kwargs):
        if self.param_dtype is not None:
            args, kwargs = cast_floats(args, self.param_dtype), cast_floats(kwargs, self.param_dtype)
        with comm.span("forward"):
            return self.ddp(*args, **kwargs)

    def _backward(self, loss):
        with comm.span("backward"):
            loss.backward()                 # bucketed: all-reduces start from the hooks in here
        self.ddp.finish_gradient_synchronization()

    def _step(self):
        with comm.span("optimizer step", "optimizer"):
            for m, p in zip(self.masters or self.trainable, self.trainable):
                if m is not p:                     # mixed precision: the fp32 master reads the mean
                    g = self._step_grad(p)
                    m.grad = None if g is None else g.to(m.dtype)   # transient 4Ψ
                if m.grad is not None and self.inv_scale != 1.0:
                    m.grad.mul_(self.inv_scale)    # loss scale out, in the master's dtype
            self.optimizer.step()
            if self.masters is not None:
                for m in self.masters:
                    m.grad = None
                self.reload_from_masters()

    def _zero_grad(self):
        self.ddp.zero_grad()

    def no_sync(self):
        return self.ddp.no_sync()

    def _step_grad(self, p):
        """The averaged gradient the step reads for p: in the reduce dtype for an fp32 master (e.g.
        fp32 when bf16 gradients were reduced in fp32), else p.grad."""
        return self.ddp.reduced_grad(p) if self.masters is not None else p.grad

    def owned_grads(self):
        # every rank holds the whole averaged gradient: replicated, counted once by clipping
        return OwnedGrads([], [g for g in map(self._step_grad, self.trainable) if g is not None])

    def _full_params(self):
        return {id(p): m.detach().clone() for p, m in zip(self.trainable, self.masters or self.trainable)}

    def param_slots(self):
        # a whole tensor per parameter, replicated: rank 0's copy is the checkpoint
        return [Slot(self.optimizer, m, [(p, 0, p.numel(), 0)], replicated=True)
                for p, m in zip(self.trainable, self.masters or self.trainable)]

    @torch.no_grad()
    def reload_from_masters(self, *, pending=False):
        if pending:
            raise ValueError("stage 0 has no delayed update: reload_from_masters(pending=True)")
        if self.masters is not None:
            for m, p in zip(self.masters, self.trainable):
                p.copy_(m)                  # round the fp32 master down to the compute dtype

    def state_tensors(self):
        """The same conventions as the ZeRO stages: frozen parameters under their own kind, and only
        per-element optimizer state (Adam's 0-dim step counters are not per-parameter memory)."""
        grads = ([b.buffer for b in self.ddp.sync.buckets] if self.ddp.sync is not None
                 else [p.grad for p in self.trainable])
        grads += self.ddp.reduced_copies()          # reduce_dtype copies, while they live
        opt = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
        trainable = {id(p) for p in self.trainable}
        frozen = [p for p in dict.fromkeys(self.module.parameters()) if id(p) not in trainable]
        return {"params": list(self.trainable), "grads": grads, "optimizer": opt,
                "master": list(self.masters or []), "frozen": frozen}
