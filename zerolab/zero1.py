"""ZeRO stage 1 (P_os): every rank keeps the full parameters and full gradients, but the optimizer
state only for the 1/N of the flat parameters it owns (Rajbhandari et al., arXiv 1910.02054, Sec. 5.1).

One step, on rank r of N, with Ψ parameters in one padded flat buffer (see :mod:`zerolab.flat`):

1. backward: full local gradients, as in data parallelism         (2Ψ bytes of bf16 grads, all ranks)
2. reduce-scatter: rank r receives the SUM of shard r of everybody's gradients, then divides by N
                                                                   ((N-1)/N x 2Ψ bytes sent per rank)
3. local step: fp32 master + Adam moments of shard r only          (KΨ/N bytes, K = 12)
4. all-gather: every rank gets every updated shard back            ((N-1)/N x 2Ψ bytes sent per rank)

Steps 2 + 4 are exactly an all-reduce cut in two halves, so ZeRO-1 moves the same 2Ψ as data
parallelism (paper Sec. 7.2.1) while model states per rank drop from (2+2+K)Ψ to 4Ψ + KΨ/N.

A parameter that gets no gradient in a step (unused in that forward) is stepped with a zero
gradient, as in DeepSpeed: its slice of the flat gradient buffer is zero, so weight decay and
momentum still act on it (torch's own optimizers skip a parameter whose ``.grad`` is None).

Two ways to use it: :class:`Zero1Optimizer`, a drop-in torch optimizer with the constructor shape of
``torch.distributed.optim.ZeroRedundancyOptimizer`` for a plain training loop, and
:class:`Zero1Engine`, stage 1 of ``zerolab.initialize``.
"""
import torch
import torch.distributed as dist

from zerolab import comm, engine
from zerolab.engine import REDUCE_IMPLS, OwnedGrads, ShardedEngine, default_reduce_impl, gather_full
from zerolab.flat import FlatParams, unique_trainable
from zerolab.shard_optim import ShardOptimizer, master_dtype


class Zero1Optimizer(torch.optim.Optimizer):
    """ZeRO-1 for a plain training loop: ``Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=...)``.

    Each param group's trainable parameters are packed into one padded flat buffer (the parameters
    become views into it, their ``.grad`` views into a flat gradient buffer). :meth:`step`
    reduce-scatters the gradients (averaging them over the group: no DDP wrapper needed; with one,
    averaging identical gradients changes them only by rounding), steps this rank's shard, and all-gathers the
    parameters. ``param_dtype`` casts the parameters for compute (e.g. bf16) while the fp32 master
    starts from their exact current values. ``reduce_impl``: 'ring' or 'torch' (default: the
    backend's best, :func:`zerolab.engine.default_reduce_impl`). ``reduce_dtype``: reduce-scatter a
    copy of the gradients in that dtype (e.g. fp32 for bf16 ones); the step reads this rank's shard
    of it (default: the gradients' own dtype). ``make_shard_optimizer(shards, init,
    **hyper)`` builds each group's optimizer over its shard (default :class:`ShardOptimizer`; the
    offload engine puts master and moments on the host).
    """

    def __init__(self, params, optimizer_class, *, param_dtype=None, group=None, reduce_impl=None,
                 reduce_dtype=None, make_shard_optimizer=None, **defaults):
        if reduce_impl not in (None,) + REDUCE_IMPLS:
            raise ValueError(f"reduce_impl={reduce_impl!r} is not supported: None, 'torch' or 'ring'")
        self.optimizer_class, self.param_dtype, self.group = optimizer_class, param_dtype, group
        self.reduce_dtype = reduce_dtype
        self.reduce_impl = reduce_impl or default_reduce_impl(group)
        self.make_shard_optimizer = make_shard_optimizer or (
            lambda shards, init, **hyper: ShardOptimizer(shards, optimizer_class, init=init, **hyper))
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.flats, self.grad_buffers, self.shard_optims = [], [], []  # one of each per param group
        self._reduced = False
        self._grad_shards = []              # after reduce_gradients: this rank's averaged shards
        super().__init__(params, defaults)  # calls add_param_group for each group

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        params = unique_trainable(self.param_groups[-1]["params"])
        if not params:
            self.flats.append(None), self.grad_buffers.append(None), self.shard_optims.append(None)
            return
        originals = [p.detach() for p in params]           # exact values, before any cast
        flat = FlatParams(params, self.world_size, self.rank, dtype=self.param_dtype)
        grads = flat.new_buffer()                          # full-size gradients: 2Ψ (bf16)
        for p, g in zip(params, flat.views(grads)):
            p.grad = g
        mdtype = master_dtype(flat.dtype)                  # fp32 for bf16 compute
        init = [flat.shard_from(originals, mdtype)] if mdtype != flat.dtype else None
        hyper = {k: v for k, v in self.param_groups[-1].items() if k != "params"}
        shard_optim = self.make_shard_optimizer(flat.shard(flat.data), init, **hyper)  # KΨ/N: own shard only
        self.flats.append(flat), self.grad_buffers.append(grads), self.shard_optims.append(shard_optim)

    def _groups(self):
        return [(f, g, s) for f, g, s in zip(self.flats, self.grad_buffers, self.shard_optims) if f is not None]

    @staticmethod
    def _adopt_grads(flat, grads):
        """Make each param's .grad the view into ``grads`` again (the user may have set it to None,
        or autograd may have allocated a fresh one after ``model.zero_grad()``)."""
        for p, view in zip(flat.params, flat.views(grads)):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view

    @torch.no_grad()
    def reduce_gradients(self):
        """Reduce-scatter: shard r of the gradient buffer on rank r becomes the average over ranks
        (sum, then / N). The rest of the buffer keeps this rank's local gradients (unused)."""
        if self._reduced:
            raise RuntimeError("gradients were already reduce-scattered since the last zero_grad(); "
                               "to accumulate micro-batches, run their backward() under no_sync()")
        self._grad_shards = []
        for flat, grads, _ in self._groups():
            self._adopt_grads(flat, grads)
            send = grads if self.reduce_dtype in (None, grads.dtype) else grads.to(self.reduce_dtype)
            own = flat.shard(send)   # in place: rank r's output is its own slice of the input
            engine.reduce_scatter(own, send, group=self.group, impl=self.reduce_impl, tag="grads")
            own.div_(self.world_size)
            # a copy in the reduce dtype: keep only this rank's shard of it, not the full buffer
            self._grad_shards.append(own if send is grads else own.clone())
        self._reduced = True

    def grad_shards(self):
        """This rank's averaged gradient shard per param group (reduce-scattering first if that has
        not happened since zero_grad): what :meth:`step` reads."""
        if not self._reduced:
            self.reduce_gradients()
        return list(self._grad_shards)

    @torch.no_grad()
    def step(self, closure=None, *, inv_scale=1.0):
        """Reduce-scatter (if not done yet), step this rank's shard, all-gather. ``inv_scale``: the
        shard's fp32 gradient is multiplied by it first (1 / loss scale)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_shards = self.grad_shards()
        for group, shard_optim in zip(self.param_groups, self.shard_optims):
            if shard_optim is not None:  # learning-rate schedules change self.param_groups
                shard_optim.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
        for (flat, _, shard_optim), grad in zip(self._groups(), grad_shards):
            shard_optim.step(grad, inv_scale=inv_scale)     # local update of shard r only
            comm.all_gather(flat.data, flat.shard(flat.data), group=self.group, tag="params")  # full params
        return loss

    @torch.no_grad()
    def zero_grad(self, set_to_none=True):
        """Zero the flat gradient buffers in place (``set_to_none`` is ignored: gradients stay views
        into the flat buffer, which is what makes the reduce-scatter one call)."""
        for flat, grads, _ in self._groups():
            grads.zero_()
            for p, view in zip(flat.params, flat.views(grads)):
                p.grad = view
        self._reduced, self._grad_shards = False, []

    def full_fp32(self):
        """Per param group, the full fp32 flat parameters (gathered from the master shards when
        training in lower precision). A collective: call it on every rank."""
        out = []
        for flat, _, shard_optim in self._groups():
            if shard_optim.aliased(0):
                out.append(flat.data.clone())
            else:
                out.append(gather_full(flat, shard_optim.master[0], self.group))
        return out

    def state_tensors(self):
        params = [f.data for f, _, _ in self._groups()]
        grads = [g for _, g, _ in self._groups()]
        grads += [s for s, g in zip(self._grad_shards, grads)                # + reduce_dtype copies
                  if s.untyped_storage().data_ptr() != g.untyped_storage().data_ptr()]
        shard = [s.state_tensors() for _, _, s in self._groups()]
        return {"params": params, "grads": grads,
                "master": [t for s in shard for t in s["master"]],
                "optimizer": [t for s in shard for t in s["optimizer"]]}

    def padding_bytes(self):
        total = 0
        for i, (flat, grads, shard_optim) in enumerate(self._groups()):
            total += flat.padding * (flat.data.element_size() + grads.element_size())  # full buffers
            total += flat.shard_padding() * shard_optim.element_bytes(0)            # shard-sized ones
            if i < len(self._grad_shards) and self._grad_shards[i].untyped_storage().data_ptr() \
                    != grads.untyped_storage().data_ptr():                           # reduce_dtype copy
                total += flat.shard_padding() * self._grad_shards[i].element_size()
        return total


class Zero1Engine(ShardedEngine):
    """Stage 1 of ``zerolab.initialize``: the model computes on views into one flat buffer per
    dtype; :class:`Zero1Optimizer` does the reduce-scatter (end of backward), the shard step and
    the all-gather (step). Per rank: 4Ψ + KΨ/N bytes of model states (+ padding, + frozen)."""

    stage = 1

    def __init__(self, module, **common):
        super().__init__(module, **common)
        trainable = self._prepare()
        self.optimizer = Zero1Optimizer(
            trainable, self.optimizer_class, param_dtype=self.param_dtype, group=self.group,
            reduce_impl=self.reduce_impl, reduce_dtype=self.reduce_dtype, **self.opt_kwargs,
            make_shard_optimizer=lambda shards, init, **hyper: self._make_shard_optimizer(shards, init))

    def _backward(self, loss):
        with comm.span("backward"):
            loss.backward()                   # full local grads land in the flat gradient buffer
        if self._sync:
            self.optimizer.reduce_gradients()  # shard r of the average -> rank r

    def _step(self):
        self.optimizer.step(inv_scale=self.inv_scale)   # local shard update, then all-gather of the params

    def owned_grads(self):
        return OwnedGrads(self.optimizer.grad_shards(), [])

    def _zero_grad(self):
        self.optimizer.zero_grad()

    def shards(self):
        return [(f, s, 0) for f, _, s in self.optimizer._groups()]   # one flat buffer per param group

    def state_tensors(self):
        return dict(self.optimizer.state_tensors(), frozen=self.frozen)

    def padding_bytes(self):
        return self.optimizer.padding_bytes()
