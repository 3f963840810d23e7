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
:class:`Zero1Engine`, stage 1 of ``zerolab.initialize``. :class:`ShardedEngine` holds what the
ZeRO-1 and ZeRO-2 engines share (mixed-precision casting, no_sync, gathering a full state dict).
"""
import contextlib

import torch
import torch.distributed as dist

from zerolab import comm
from zerolab.engine import Engine
from zerolab.flat import FlatParams, unique_trainable
from zerolab.shard_optim import ShardOptimizer, master_dtype

# Which reduce-scatter the engines use on gloo. There torch's reduce_scatter is emulated with a full
# all-reduce (2x the bytes); lesson 00's ring from send/recv sends (N-1)/N and measured faster here
# for large buffers (lesson 04 and benchmarks/bench_zero12.py show both). NCCL has a real one, so on
# GPUs the engines use torch's (see default_reduce_impl). Set engine.reduce_impl to override.
REDUCE_SCATTER_IMPL = "ring"


def default_reduce_impl(group=None):
    """'torch' on NCCL (a native reduce-scatter), else REDUCE_SCATTER_IMPL (the ring, on gloo)."""
    return "torch" if dist.get_backend(group) == "nccl" else REDUCE_SCATTER_IMPL


def gather_full(flat, shard, group=None):
    """All-gather ``shard`` (this rank's slice, any dtype) into a new full buffer laid out like
    ``flat.data``: how a full fp32 state dict is rebuilt from fp32 master shards."""
    full = torch.empty(flat.padded_numel, dtype=shard.dtype, device=flat.device)
    comm.all_gather(full, shard.to(flat.device), group=group)
    return full


class Zero1Optimizer(torch.optim.Optimizer):
    """ZeRO-1 for a plain training loop: ``Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=...)``.

    Each param group's trainable parameters are packed into one padded flat buffer (the parameters
    become views into it, their ``.grad`` views into a flat gradient buffer). :meth:`step`
    reduce-scatters the gradients (averaging them over the group: no DDP wrapper needed; with one,
    averaging identical gradients changes them only by rounding), steps this rank's shard, and all-gathers the
    parameters. ``param_dtype`` casts the parameters for compute (e.g. bf16) while the fp32 master
    starts from their exact current values. ``master_device`` places master and moments (offload).
    """

    def __init__(self, params, optimizer_class, *, param_dtype=None, group=None, master_device=None,
                 reduce_impl=None, **defaults):
        self.optimizer_class, self.param_dtype, self.group = optimizer_class, param_dtype, group
        self.master_device, self.reduce_impl = master_device, reduce_impl or default_reduce_impl(group)
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.flats, self.grad_buffers, self.shard_optims = [], [], []  # one of each per param group
        self._reduced = False
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
        shard_optim = ShardOptimizer(flat.shard(flat.data), self.optimizer_class, init=init,
                                     device=self.master_device, **hyper)  # KΨ/N: own shard only
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
        for flat, grads, _ in self._groups():
            self._adopt_grads(flat, grads)
            own = flat.shard(grads)  # in place: rank r's output is its own slice of the input
            comm.reduce_scatter(own, grads, group=self.group, impl=self.reduce_impl)
            own.div_(self.world_size)
        self._reduced = True

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._reduced:
            self.reduce_gradients()
        for group, shard_optim in zip(self.param_groups, self.shard_optims):
            if shard_optim is not None:  # learning-rate schedules change self.param_groups
                shard_optim.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
        for flat, grads, shard_optim in self._groups():
            shard_optim.step(flat.shard(grads))             # local update of shard r only
            comm.all_gather(flat.data, flat.shard(flat.data), group=self.group)  # rebuild full params
        return loss

    @torch.no_grad()
    def zero_grad(self, set_to_none=True):
        """Zero the flat gradient buffers in place (``set_to_none`` is ignored: gradients stay views
        into the flat buffer, which is what makes the reduce-scatter one call)."""
        for flat, grads, _ in self._groups():
            grads.zero_()
            for p, view in zip(flat.params, flat.views(grads)):
                p.grad = view
        self._reduced = False

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
        shard = [s.state_tensors() for _, _, s in self._groups()]
        return {"params": params, "grads": grads,
                "master": [t for s in shard for t in s["master"]],
                "optimizer": [t for s in shard for t in s["optimizer"]]}

    def padding_bytes(self):
        total = 0
        for flat, grads, shard_optim in self._groups():
            total += flat.padding * (flat.data.element_size() + grads.element_size())  # full buffers
            total += flat.shard_padding() * shard_optim.element_bytes(0)            # shard-sized ones
        return total


class ShardedEngine(Engine):
    """What the ZeRO-1 and ZeRO-2 engines share: casting the model for mixed precision (trainable
    parameters are packed by the subclass; frozen ones and floating buffers are cast here), casting
    floating inputs, no_sync, and a full fp32 state dict from flat buffers. Frozen parameters are
    reported under their own kind, 'frozen' (replicated, no grads, no optimizer state), so that
    'params' + 'grads' + 'master' + 'optimizer' is exactly what the ZeRO formulas count."""

    host_kinds = ("master", "optimizer")   # offload='optimizer': ShardOptimizer keeps them on the host

    def _prepare(self):
        """Returns the trainable parameters (each once) and casts everything else to param_dtype."""
        self.trainable = unique_trainable(self.module.parameters())
        trainable_ids = {id(p) for p in self.trainable}
        self.frozen = [p for p in dict.fromkeys(self.module.parameters()) if id(p) not in trainable_ids]
        dtypes = {p.dtype for p in self.trainable}
        if self.param_dtype is None and len(dtypes) > 1:
            raise ValueError(f"trainable parameters have several dtypes {sorted(map(str, dtypes))}: "
                             f"pass param_dtype to train them in one")
        self.compute_dtype = self.param_dtype or self.trainable[0].dtype
        with torch.no_grad():
            for t in self.frozen + list(self.module.buffers()):
                if t.is_floating_point():
                    t.data = t.data.to(self.compute_dtype)   # frozen: replicated, no grads, no state
        self._sync = True
        return self.trainable

    def forward(self, *args, **kwargs):
        cast = lambda x: x.to(self.compute_dtype) if torch.is_tensor(x) and x.is_floating_point() else x
        return self.module(*map(cast, args), **{k: cast(v) for k, v in kwargs.items()})

    @contextlib.contextmanager
    def no_sync(self):
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _full_state(self, flats, fulls):
        """{name: fp32 (fp64 for fp64 models) tensor} from flat buffers ``flats`` and their full fp32 contents ``fulls``."""
        by_id = {}
        for flat, full in zip(flats, fulls):
            for p, view in zip(flat.params, flat.views(full)):
                by_id[id(p)] = view.clone()
        return {name: by_id[id(p)] if id(p) in by_id else p.detach().to(master_dtype(p.dtype)).clone()
                for name, p in self.module.named_parameters()}


class Zero1Engine(ShardedEngine):
    """Stage 1 of ``zerolab.initialize``: the model computes on views into one flat buffer per
    dtype; :class:`Zero1Optimizer` does the reduce-scatter (end of backward), the shard step and
    the all-gather (step). Per rank: 4Ψ + KΨ/N bytes of model states (+ padding, + frozen)."""

    stage = 1

    def __init__(self, module, **options):
        super().__init__(module, **options)
        trainable = self._prepare()
        self.optimizer = Zero1Optimizer(
            trainable, self.optimizer_class, param_dtype=self.param_dtype, group=self.group,
            master_device="cpu" if self.offload == "optimizer" else None, **self.opt_kwargs)

    @property
    def reduce_impl(self):
        return self.optimizer.reduce_impl

    @reduce_impl.setter
    def reduce_impl(self, impl):
        if impl not in ("torch", "ring"):
            raise ValueError(f"reduce_impl={impl!r} is not supported: use 'torch' or 'ring'")
        self.optimizer.reduce_impl = impl

    def _backward(self, loss):
        loss.backward()                       # full local grads land in the flat gradient buffer
        if self._sync:
            self.optimizer.reduce_gradients()  # shard r of the average -> rank r

    def _step(self):
        self.optimizer.step()                 # local shard update, then all-gather of the params

    def zero_grad(self):
        self.optimizer.zero_grad()

    def full_state_dict(self):
        return self._full_state([f for f, _, _ in self.optimizer._groups()], self.optimizer.full_fp32())

    def shards(self):
        return [(f, s, 0) for f, _, s in self.optimizer._groups()]   # one flat buffer per param group

    def state_tensors(self):
        return dict(self.optimizer.state_tensors(), frozen=self.frozen)

    def padding_bytes(self):
        return self.optimizer.padding_bytes()
