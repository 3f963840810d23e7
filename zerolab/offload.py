"""CPU offload, ZeRO-Offload style (Ren et al., USENIX ATC 2021, arXiv 2101.06840): the device keeps
the compute-precision parameters and runs forward and backward; each rank's gradient shard, its fp32
master shard, the optimizer moments and the update itself live on the host.

One step on rank r of N, Ψ parameters, bf16 compute (paper Sec. 4.1, Fig. 2; split over N ranks):

    device (GPU)                                 host (CPU)
    bf16 params, full: 2Ψ                        fp32 master shard 4Ψ/N, Adam m and v 8Ψ/N
    forward + backward: O(Ψ·tokens) compute
    reduce-scatter: shard r of the grads  --->   bf16 grad shard 2Ψ/N (pinned)        2Ψ/N bytes down
                                                 upcast, Adam on the master shard     O(Ψ/N), memory-bound
    bf16 param shard r                    <---   cast to bf16 (same pinned buffer)    2Ψ/N bytes up
    all-gather the params

Why this cut (paper Sec. 3, the data-flow graph and its optimal cut): all compute that grows with the batch stays on the fast device, which
keeps only what it needs (the 2-byte params; gradients while backward produces them); the update is
O(Ψ) and memory-bound, so the host can run it; and only gradients (down) and parameters (up) cross
the host link: 4Ψ bytes per step (4Ψ/N per rank), the least any offload of the optimizer can move.

This module adds, for ``initialize(..., stage=1, 2 or 3, offload="optimizer")``:

* :class:`HostOptimizer`: a pinned host gradient buffer (page-locked memory: ``non_blocking`` copies
  are asynchronous DMAs), the fp32 master (always its own copy), torch's fused CPU kernel where it
  exists (``fused=True``; else the default one), cast + copy back. Optional, OFF by default, clearly
  one step stale: the delayed parameter update (DPU, paper Sec. 5.2).
* :class:`Zero1OffloadEngine`, :class:`Zero2OffloadEngine`, :class:`Zero3OffloadEngine`: each stage
  with the host optimizer, through the stages' construction hooks (``_make_shard_optimizer``,
  ``_keep_grad_shard``): stages 2 and 3 send each bucket's / unit's shard to the host as its
  reduce-scatter lands, during backward. Stage 3 + offload is ZeRO-Infinity's optimizer offload
  (DeepSpeed's ``offload_optimizer`` at stage 3): device model states 2Ψ/N (the bf16 parameter shard)
  plus gathered units while they compute; FSDP2's CPUOffloadPolicy offloads the parameters too.

On a CPU-only machine "device" and "host" are the same memory: nothing moves physically, and
:meth:`zerolab.engine.Engine.placement` is accounting BY ROLE (``host_kinds``), not by tensor.device.
"""
import threading

import torch

from zerolab import comm, cpu_adam
from zerolab.shard_optim import ShardOptimizer, master_dtype
from zerolab.zero1 import Zero1Engine
from zerolab.zero2 import Zero2Engine
from zerolab.zero3 import Zero3Engine

HOST = torch.device("cpu")


def host_buffer(numel, dtype, *, like):
    """A zeroed 1-D host tensor for copies to/from ``like``'s device: pinned when that device is a
    GPU (page-locked memory is what lets ``copy_(..., non_blocking=True)`` run as an async DMA)."""
    return torch.zeros(numel, dtype=dtype, device=HOST, pin_memory=like.is_cuda)


def host_optimizer(params, optimizer_class, *, fused=None, **opt_kwargs):
    """``optimizer_class(params, **opt_kwargs)`` for host tensors, returned with whether it is fused.

    ``fused=None``: torch's fused CPU kernel (one vectorised, multithreaded pass over p, g, m, v;
    the counterpart of the paper's CPU-Adam, Sec. 5.1) when this optimizer/dtype/torch has one,
    else the default implementation (a for-loop over tensors on CPU). ``fused=True/False``: as asked.
    """
    if fused is None:
        try:
            return optimizer_class(params, fused=True, **opt_kwargs), True
        except (RuntimeError, TypeError, ValueError):
            pass            # no fused CPU kernel here (or foreach=True was asked): the default one
        return optimizer_class(params, **opt_kwargs), False
    return optimizer_class(params, fused=fused, **opt_kwargs), bool(fused)


def one_pass_kernel(optimizer, fused):
    """zerolab.cpu_adam's compiled one-pass AdamW (see that module) when it can run ``optimizer``'s
    update: a torch.optim.AdamW on torch's fused CPU kernel (``fused=None``, the default: asked for
    nothing else), one param group of fp32 tensors, no amsgrad, maximize or differentiable; the
    kernel then reads and writes the optimizer's own state (step, exp_avg, exp_avg_sq), as torch's
    fused kernel does. None otherwise, or where no C compiler can build it (torch's kernels then run)."""
    groups = optimizer.param_groups
    if (fused is not None or type(optimizer) is not torch.optim.AdamW or len(groups) != 1
            or not groups[0]["fused"] or groups[0]["amsgrad"] or groups[0]["maximize"]
            or groups[0]["differentiable"] or any(p.dtype != torch.float32 for p in groups[0]["params"])):
        return None
    return cpu_adam.load()


class HostOptimizer(ShardOptimizer):
    """A :class:`~zerolab.shard_optim.ShardOptimizer` whose master, moments, gradient shard and
    update live on the host. ``shards``: this rank's device shard(s), compute dtype; ``init``: their
    exact fp32 initial values (a host fp32 tensor is adopted without a copy). ``self.grads``: the host
    gradient shard(s), views into ``grad_flat``; ``bytes_to_host`` / ``bytes_to_device``: what crossed.

    ``grad_dtype``: the host gradient shard's dtype (default the shards'; the engines pass their
    ``reduce_dtype``, so an fp32-reduced gradient is not rounded on its way to the host).

    The update's kernel (``self.one_pass``; ``fused`` as for :func:`host_optimizer`): by default, for
    AdamW, one pass over memory that reads the host gradient shard in its own dtype and writes the
    shard in the compute dtype in the same loop (:mod:`zerolab.cpu_adam`: 28 bytes per parameter in
    bf16, what torch's fused AdamW moves in fp32); where that kernel cannot be built, or with any
    other optimizer, torch's kernel, with the gradient cast up into an fp32 workspace before it and
    the master cast down after it (40 bytes per parameter in bf16).

    Delayed parameter update (``delayed = True``; paper Sec. 5.2): :meth:`step` starts the host
    update in a background thread and returns; the device runs the NEXT forward/backward on the
    parameters it has; the result goes up at the next step. So p_t = p_{t-1} - u(g_t(p_{t-2})):
    each gradient is taken one update behind (the paper turns DPU on after a warm-up of normal steps).
    """

    def __init__(self, shards, optimizer_class, *, init=None, fused=None, grad_dtype=None, **opt_kwargs):
        self.shards = [shards] if torch.is_tensor(shards) else list(shards)
        init = [None] * len(self.shards) if init is None else list(init)
        if not self.shards or any(s.dim() != 1 for s in self.shards) or len({s.dtype for s in self.shards}) != 1 \
                or len(init) != len(self.shards):
            raise ValueError(f"HostOptimizer needs 1-D shards of one dtype and one init per shard, got shards "
                             f"{[(tuple(s.shape), str(s.dtype)) for s in self.shards]} and {len(init)} init")
        dtype = master_dtype(self.shards[0].dtype)
        self.master = []
        for shard, start in zip(self.shards, init):
            if start is not None and start is not shard and start.device == HOST and start.dtype == dtype:
                self.master.append(start.detach())          # a separate host fp32 copy already: adopt
            else:     # always its own copy, fp32 training included: on a GPU system it is other memory
                self.master.append((shard if start is None else start).detach().to(HOST, dtype, copy=True))
        self.optimizer, self.fused = host_optimizer(self.master, optimizer_class, fused=fused, **opt_kwargs)
        sizes = [s.numel() for s in self.shards]
        self.grad_flat = host_buffer(sum(sizes), grad_dtype or self.shards[0].dtype, like=self.shards[0])
        self.one_pass = (one_pass_kernel(self.optimizer, fused)    # the compiled kernel, or None
                         if self.grad_flat.dtype in cpu_adam.DTYPE_NAMES else None)
        self.grads = list(self.grad_flat.split(sizes))          # the host gradient shard(s)
        self.workspace = None                                   # the gradient the update reads, if a copy
        self._inputs, self._inv_scale = None, 1.0               # what the next _update reads
        self._cast = set()                                      # shards the last update already wrote
        self._fresh = [True] * len(self.shards)                 # no gradient arrived since zero_grad
        self._unread = False                                    # gradients arrived, not yet stepped
        self._copied = None                                     # CUDA event after the last copy
        self._job, self._error = None, None                     # the running delayed update
        self._unsent = False                                    # an update the device does not have
        self.delayed = False
        self.bytes_to_host = self.bytes_to_device = 0

    def aliased(self, i):
        return False                                            # the master is never the shard

    def element_bytes(self, i):
        return super().element_bytes(i) + (0 if self.workspace is None else self.workspace.element_size())

    # -- device -> host --------------------------------------------------------------------
    @torch.no_grad()
    def to_host(self, i, grad):
        """Send gradient shard i (on the device) into ``self.grads[i]``: asynchronously on CUDA; a
        copy the first time after :meth:`zero_grad`, an add on the host after that (accumulation)."""
        if self._fresh[i]:
            self.grads[i].copy_(grad, non_blocking=True)        # pinned destination: async D2H
            self._fresh[i] = False
        else:
            self.grads[i].add_(grad.to(HOST))                   # blocking copy, add on the host
        self.bytes_to_host += grad.numel() * grad.element_size()
        self._unread = True
        self._record(grad)

    def _record(self, device_tensor):
        if device_tensor.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()                              # copies run in stream order: the last suffices

    def _landed(self):
        if self._copied is not None:
            self._copied.synchronize()                         # the host may now touch self.grads
            self._copied = None

    def zero_grad(self):
        self._landed()
        self.grad_flat.zero_()
        self._fresh, self._unread = [True] * len(self.shards), False

    # -- the host update ---------------------------------------------------------------------
    @torch.no_grad()
    def step(self, grads=None, *, inv_scale=1.0):
        """One update. ``grads``: the device gradient shard(s), sent to the host first (stage 1);
        entries that are already ``self.grads`` (stage 2 sent them during backward), or None, are
        used as they are. ``inv_scale``: the fp32 gradient is multiplied by it (1 / loss scale)."""
        grads = [] if grads is None else [grads] if torch.is_tensor(grads) else list(grads)
        if grads and [g.shape for g in grads] != [s.shape for s in self.shards]:
            raise ValueError(f"HostOptimizer.step: gradient shapes {[tuple(g.shape) for g in grads]} "
                             f"for shards {[tuple(s.shape) for s in self.shards]}")
        for i, g in enumerate(grads):
            if g is not self.grads[i]:
                self._fresh[i] = True
                self.to_host(i, g)
        self._landed()
        self.wait()                                           # DPU: the previous update is done
        self._inputs = [self._input(i, g) for i, g in enumerate(self.grads)]
        self._inv_scale = inv_scale                           # the loss scale out, in fp32, on the host
        self._unread = False
        if self._unsent:                                      # DPU: the previous update's result goes up
            self.write_back()
        if self.delayed:
            self._job = threading.Thread(target=self._update, name="zerolab-host-update", daemon=True)
            self._job.start()                                 # overlaps the next forward/backward
            self._unsent = True
        else:
            self._update(cast=True)                           # casts into host shards in the same pass
            self._raise()
            self.write_back()

    def _input(self, i, g):
        """The gradient the update reads: the host shard itself, or a copy in a persistent workspace
        when the kernel needs another dtype (torch's reads the master's: the bf16 -> fp32 upcast, 4Ψ/N
        bytes) or under DPU (the next backward refills self.grads while the update runs). Persistent:
        a fresh Ψ/N tensor every step would cost its page faults each time, measured here ~5x the copy."""
        dtype = g.dtype if self.one_pass is not None else self.master[i].dtype
        if g.dtype == dtype and not self.delayed:
            return g
        if self.workspace is None:
            self.workspace = torch.empty(sum(x.numel() for x in self.master), dtype=dtype)
        off = sum(x.numel() for x in self.master[:i])
        return self.workspace[off:off + g.numel()].copy_(g)

    def _update(self, cast=False):
        """The update on the host: master, m, v (KΨ/N). ``cast``: the one-pass kernel also writes each
        host shard (the compute-dtype parameters), which :meth:`write_back` then skips; never under
        DPU, where the device computes on the old shard while this runs."""
        try:
            with comm.span("host optimizer step", "optimizer"):
                if self.one_pass is not None:
                    self._one_pass_update(cast)
                else:
                    for m, g in zip(self.master, self._inputs):
                        m.grad = g if self._inv_scale == 1.0 else g.mul_(self._inv_scale)
                    self.optimizer.step()                      # torch's kernel
        except BaseException as exc:                           # re-raised in the training thread
            self._error = exc
        for m in self.master:
            m.grad = None

    def _one_pass_update(self, cast):
        group = self.optimizer.param_groups[0]
        self._cast.clear()
        for i, (m, g, shard) in enumerate(zip(self.master, self._inputs, self.shards)):
            state = self.optimizer.state[m]
            if not state:                   # as torch's fused AdamW creates them at its first step
                state.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(m),
                             exp_avg_sq=torch.zeros_like(m))
            state["step"] += 1
            out = shard if cast and shard.device == HOST and cpu_adam.supports(m, g, shard) else None
            cpu_adam.adamw_(self.one_pass, m, g, state["exp_avg"], state["exp_avg_sq"], out,
                            step=state["step"].item(), lr=float(group["lr"]), beta1=group["betas"][0],
                            beta2=group["betas"][1], eps=group["eps"], weight_decay=group["weight_decay"],
                            grad_scale=self._inv_scale)
            if out is not None:
                self._cast.add(i)

    def _raise(self):
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc

    def wait(self):
        """Join the running delayed update, if any: the master and moments are then current."""
        if self._job is not None:
            self._job.join()
            self._job = None
        self._raise()

    def pending(self):
        """True if a delayed update has run whose result the device does not have yet."""
        return self._unsent

    def mark_pending(self):
        """The device shard(s) were set one update behind the master (a checkpoint saved during a
        delayed update was loaded): the master goes up at the next step(), as after a delayed step."""
        self.wait()
        self._unsent = True

    @torch.no_grad()
    def write_back(self):
        """Cast the fp32 master into the compute dtype and copy it into the device shard(s). On a GPU
        the pinned gradient buffer, already read by the step, is the staging buffer on the way up."""
        for i, (m, shard, staging) in enumerate(zip(self.master, self.shards, self.grads)):
            if shard.device == HOST:
                if i not in self._cast:                        # (the one-pass kernel wrote it already)
                    shard.copy_(m)                             # one memory: cast in place
            elif self._unread or staging.dtype != shard.dtype:  # gradients wait in the staging buffer
                shard.copy_(m)                                 # (a checkpoint load), or it is fp32: blocking
            else:
                staging.copy_(m)                               # cast on the host, into pinned memory,
                shard.copy_(staging, non_blocking=True)        # then async H2D before the all-gather
                self._record(shard)
            self.bytes_to_device += shard.numel() * shard.element_size()
        self._cast.clear()
        self._unsent = False

    def flush(self):
        """Finish a delayed update and write its result into the device shard(s) (the caller then
        all-gathers): afterwards nothing is pending. Call it after step(), not between backward()
        and step() (the gradient buffer is the staging buffer on the way up)."""
        if self._unsent:
            if self._unread:
                raise RuntimeError("flush() between backward() and step(): call it after step()")
            self.wait()
            self.write_back()

    def state_tensors(self):
        """The base kinds plus 'host_grads' (the host gradient shard) and 'workspace' (the copy of the
        gradient the update reads: fp32 for torch's kernel in bf16 training, and under DPU): all on
        the host."""
        self.wait()                                            # no reading state while it is updated
        return dict(super().state_tensors(), host_grads=[self.grad_flat],
                    workspace=[] if self.workspace is None else [self.workspace])


class _Offload:
    """What offload adds to every stage: the host optimizer (through the stage's construction hook),
    placement by role, the DPU switch, traffic counters, flush. The stage-specific classes below say
    only where a reduced gradient shard goes."""

    offloaded = True
    # ZeRO-Offload: fp32 master, optimizer moments and the reduce-scattered gradient shard live on
    # the host (arXiv 2101.06840, Sec. 4.1); everything else (the compute-dtype params, gradients
    # while backward produces them, frozen params) stays on the device.
    host_kinds = ("master", "optimizer", "host_grads", "workspace")

    def _make_shard_optimizer(self, shards, init):
        return HostOptimizer(shards, self.optimizer_class, init=init, grad_dtype=self.reduce_dtype,
                             **self.opt_kwargs)

    def owned_grads(self):
        for h in self.host_optimizers():
            h._landed()                   # the host gradient shards are complete (CUDA: copies done)
        return super().owned_grads()

    def host_optimizers(self):
        return list(dict.fromkeys(so for _, so, _ in self.shards()))

    @property
    def delayed_update(self):
        """Delayed parameter update (paper Sec. 5.2; one step stale, see :class:`HostOptimizer`).
        Off by default; set it True after some warm-up steps, as the paper does."""
        return all(h.delayed for h in self.host_optimizers())

    @delayed_update.setter
    def delayed_update(self, on):
        if on not in (True, False):
            raise ValueError(f"delayed_update must be True or False, got {on!r}")
        for h in self.host_optimizers():
            h.delayed = on

    def host_traffic(self):
        """{'to_host': bytes, 'to_device': bytes} sent across the device-host boundary so far by this
        rank (theory, per step: 2Ψ/N each way in bf16, ZeRO-Offload Sec. 4.1)."""
        hs = self.host_optimizers()
        return {"to_host": sum(h.bytes_to_host for h in hs), "to_device": sum(h.bytes_to_device for h in hs)}

    def flush(self):
        """Apply a pending delayed update to the device parameters (then publish them: all-gather at
        stages 1-2, re-gather at next use at stage 3): call it before evaluating the model when
        ``delayed_update`` is on. Every rank must call it."""
        if any(h.pending() for h in self.host_optimizers()):
            for h in self.host_optimizers():
                h.flush()
            self._publish()

    def quiesce(self):
        super().quiesce()
        for h in self.host_optimizers():
            h.wait()                  # the master is the newest state; a delayed update stays pending
                                      # (flushing it here made a checkpoint save change the run)

    @property
    def update_pending(self):
        return any(h.pending() for h in self.host_optimizers())

    def param_slots(self):
        slots = super().param_slots()
        for slot, (_, so, i) in zip(slots, self.shards()):
            slot.device = so.shards[i]             # the device shard the model's parameters come from
        return slots

    def reload_from_masters(self, *, pending=False):
        if not pending:
            return super().reload_from_masters()
        if not self.delayed_update:
            raise ValueError("reload_from_masters(pending=True) needs delayed_update = True")
        for h in self.host_optimizers():
            h.mark_pending()                       # the masters go up at the next step()
        self._publish()                            # the device shards the caller wrote

    def full_state_dict(self):
        for h in self.host_optimizers():
            h.wait()                      # the master is the newest state (a delayed update stays pending)
        return super().full_state_dict()

    def _zero_grad(self):
        for h in self.host_optimizers():
            h.zero_grad()
        super()._zero_grad()

    def state_tensors(self):
        host = [h.state_tensors() for h in self.host_optimizers()]
        return dict(super().state_tensors(), host_grads=[t for h in host for t in h["host_grads"]],
                    workspace=[t for h in host for t in h["workspace"]])

    def padding_bytes(self):
        return super().padding_bytes() + sum(flat.shard_padding() * so.grad_flat.element_size()
                                              for flat, so, _ in self.shards())


class Zero1OffloadEngine(_Offload, Zero1Engine):
    """ZeRO-1 + offload: the full gradient is still on the device until the reduce-scatter at the end
    of backward; at the step, shard r goes to the host, is updated there and comes back."""


class Zero2OffloadEngine(_Offload, Zero2Engine):
    """ZeRO-2 + offload, the paper's configuration: as each bucket's reduce-scatter lands (during
    backward) its averaged shard goes to the host; the device keeps no gradient shard at all."""

    def _new_grad_shards(self, sizes):
        return None, self.shard_optim.grads    # the host's, pinned; none on the device

    def _keep_grad_shard(self, i, shard):
        self.shard_optim.to_host(i, shard)     # bucket i's averaged shard: device -> host, async


class Zero3OffloadEngine(_Offload, Zero3Engine):
    """ZeRO-3 + offload: as each unit's reduce-scatter lands its averaged shard goes to the host; the
    step runs there and the new bf16 shard comes back. Device: the parameter shards (2Ψ/N) and the
    units gathered while they compute."""

    def _keep_grad_shard(self, i, shard):
        self.shard_optim.to_host(i, shard)     # unit i's averaged shard: device -> host, async

    def _step_grads(self):
        return self.shard_optim.grads          # already on the host (zero for units without grads)
