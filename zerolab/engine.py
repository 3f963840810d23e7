"""The training engine: one API for data parallelism (stage 0), ZeRO stages 1-3 and CPU offload.

Modelled on DeepSpeed's engine so the skills transfer::

    engine = zerolab.initialize(model, stage=2, optimizer=torch.optim.AdamW, lr=1e-3,
                                param_dtype=torch.bfloat16)
    loss = engine(x, y)          # forward
    engine.backward(loss)        # gradients (synchronised or sharded, by stage)
    engine.step()                # optimizer step on what this rank owns
    engine.zero_grad()
    engine.full_state_dict()     # full fp32 parameters on every rank
    engine.memory_report()       # this rank's model-state bytes by kind and device
    engine.last_step_comm        # zerolab.comm.CommLog of the last step

Each stage is a subclass of :class:`Engine` in its own module (``data_parallel``, ``zero1``,
``zero2``, ``zero3``); :func:`initialize` validates the options once and picks the class.
"""
import warnings

import torch
import torch.distributed as dist

from zerolab import comm
from zerolab.memory import storage_bytes_by_kind

STAGES = (0, 1, 2, 3)
OFFLOADS = (None, "optimizer")
# Optimizers whose update is elementwise, so that running it on a flat shard of the parameters
# is the same math as running it on the whole parameters (what ZeRO's partitioning relies on).
ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


class Engine:
    """Common machinery. Subclasses implement ``_backward``, ``_step``, ``zero_grad``,
    ``full_state_dict`` and ``state_tensors`` (and may override ``forward``)."""

    stage = None

    def __init__(self, module, *, optimizer, opt_kwargs, param_dtype, offload, bucket_bytes, group):
        self.module = module
        self.optimizer_class = optimizer
        self.opt_kwargs = dict(opt_kwargs)
        self.param_dtype = param_dtype
        self.offload = offload
        self.bucket_bytes = bucket_bytes
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.last_step_comm = None
        self.steps = 0                  # optimizer steps taken (saved and restored by checkpoints)
        self._step_log = None
        self._log_cm = None

    # -- the per-step comm log: opened at the first forward after a step, closed by step() --
    def _open_step_log(self):
        if self._log_cm is None:
            self._log_cm = comm.log(self.group)
            self._step_log = self._log_cm.__enter__()

    def _close_step_log(self):
        if self._log_cm is not None:
            self._log_cm.__exit__(None, None, None)
            self.last_step_comm, self._log_cm = self._step_log, None

    def __call__(self, *args, **kwargs):
        self._open_step_log()
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss):
        self._open_step_log()
        self._backward(loss)

    def step(self):
        self._open_step_log()
        self._step()
        self.steps += 1
        self._close_step_log()

    # -- checkpoints: zerolab.checkpoint does the work, for every stage -----------------------
    def save_checkpoint(self, path, client_state=None):
        """Write this rank's shard of the training state to the folder ``path`` (every rank must
        call it). See :func:`zerolab.checkpoint.save`."""
        from zerolab import checkpoint
        return checkpoint.save(self, path, client_state=client_state)

    def load_checkpoint(self, path):
        """Load a checkpoint written by any number of ranks at any stage; returns its client_state.
        See :func:`zerolab.checkpoint.load`."""
        from zerolab import checkpoint
        return checkpoint.load(self, path)

    def shards(self):
        """[(FlatParams, ShardOptimizer, i)]: the flat buffers this rank owns a shard of, with the
        optimizer holding master i of that shard. Empty for data parallelism (nothing is sharded)."""
        return []

    # -- what every stage provides ---------------------------------------------------------
    def _backward(self, loss):
        raise NotImplementedError

    def _step(self):
        raise NotImplementedError

    def zero_grad(self):
        raise NotImplementedError

    def no_sync(self):
        """Context manager for gradient accumulation: backward() inside it accumulates locally and
        skips communication; the first backward() outside it synchronises the sum (torch DDP's idiom)."""
        raise NotImplementedError

    def full_state_dict(self):
        """{name: full fp32 tensor} of the model's parameters, identical on every rank."""
        raise NotImplementedError

    def state_tensors(self):
        """{kind: [tensors]} of what this rank holds, kinds from zerolab.memory.KINDS."""
        raise NotImplementedError

    def padding_bytes(self):
        """Bytes of zero padding included in state_tensors() (flat buffers rounded up to N)."""
        return 0

    # Kinds of state that live on the host under offload (ZeRO-Offload, arXiv 2101.06840: fp32
    # master and Adam moments go to the host; the offload engines extend this with their grads).
    host_kinds = ()

    def placement(self):
        """{'device': bytes, 'host': bytes} of this rank's model states BY ROLE: what would sit on
        the accelerator and what on the host. On a CPU-only machine both are the same memory, so
        the split comes from the design (``host_kinds``), not from tensor.device."""
        report = storage_bytes_by_kind(self.state_tensors())
        out = {"device": 0, "host": 0}
        for kind, per_device in report.items():
            out["host" if self.offload and kind in self.host_kinds else "device"] += sum(per_device.values())
        return out

    def memory_report(self):
        """This rank's model-state bytes: {kind: {device: bytes}} plus 'padding': bytes."""
        report = storage_bytes_by_kind(self.state_tensors())
        report["padding"] = self.padding_bytes()
        return report


def _validate(model, stage, optimizer, lr, param_dtype, offload, bucket_bytes, group):
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r} is not supported: choose one of {STAGES}")
    if offload not in OFFLOADS:
        raise ValueError(f"offload={offload!r} is not supported: choose one of {OFFLOADS}")
    if offload is not None and stage == 0:
        raise ValueError("offload='optimizer' needs a sharded optimizer: use stage 1, 2 or 3 "
                         "(ZeRO-Offload offloads each rank's partition)")
    if isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer class such as torch.optim.AdamW, not an "
                         f"instance ({type(optimizer).__name__}): the engine builds it over what this rank "
                         f"owns; pass its arguments to initialize (lr=..., weight_decay=...)")
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer class, got {optimizer!r}")
    if stage > 0 and not issubclass(optimizer, ELEMENTWISE_OPTIMIZERS):
        names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        raise ValueError(f"stage {stage} shards the optimizer over flat parameter slices, which is "
                         f"exact only for elementwise optimizers ({names}); got {optimizer.__name__}")
    if not (isinstance(lr, (int, float)) and lr > 0):
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    if param_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"param_dtype={param_dtype!r} is not supported: None (keep the model's), "
                         f"torch.float32, torch.bfloat16 or torch.float16")
    if bucket_bytes is not None and (not isinstance(bucket_bytes, int) or bucket_bytes <= 0):
        raise ValueError(f"bucket_bytes must be a positive int or None, got {bucket_bytes!r}")
    if not dist.is_initialized():
        raise ValueError("no process group: call zerolab.initialize inside zerolab.launch / "
                         "zerolab.Cluster.run, or under torchrun after zerolab.init_from_env()")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameters (all requires_grad=False)")
    bad = [n for n, p in model.named_parameters() if not p.dtype.is_floating_point]
    if bad:
        raise ValueError(f"parameters must be floating point; not so: {bad}")
    n, numel = dist.get_world_size(group), sum(p.numel() for p in dict.fromkeys(model.parameters()) if p.requires_grad)
    if stage > 0 and n > numel:
        warnings.warn(f"world_size={n} is more ranks than the model has trainable elements ({numel}): "
                      f"{n - numel} rank(s) own only zero padding. Sharding cannot save memory here; "
                      f"use fewer ranks or a larger model", UserWarning, stacklevel=3)


def initialize(model, *, stage=0, optimizer=torch.optim.AdamW, lr=1e-3, param_dtype=None,
               offload=None, bucket_bytes=25 * 2**20, group=None, **opt_kwargs):
    """Wrap ``model`` in the engine for ``stage`` (0 = data parallel, 1/2/3 = ZeRO) on ``group``.

    ``optimizer`` is a class (built by the engine on what this rank owns), ``lr`` and
    ``opt_kwargs`` its arguments. ``param_dtype=torch.bfloat16`` trains in mixed precision:
    2-byte params and grads for compute, fp32 master weights and Adam moments (K = 12).
    ``offload='optimizer'`` keeps the fp32 master and moments on the host (ZeRO-Offload).
    ``bucket_bytes``: gradient bucket size for communication. Raises ValueError naming any bad
    value. Every rank must call it with the same model (checked).
    """
    _validate(model, stage, optimizer, lr, param_dtype, offload, bucket_bytes, group)
    # Import only the chosen stage's module (a stage still being written must not break the others).
    import importlib
    module_name, class_name = {0: ("data_parallel", "DataParallelEngine"), 1: ("zero1", "Zero1Engine"),
                               2: ("zero2", "Zero2Engine"), 3: ("zero3", "Zero3Engine")}[stage]
    if offload == "optimizer" and stage in (1, 2):   # ZeRO-Offload on top of stage 1/2: zerolab.offload
        module_name, class_name = "offload", f"Zero{stage}OffloadEngine"
    cls = getattr(importlib.import_module(f"zerolab.{module_name}"), class_name)
    check_same_model(model, group)
    return cls(model, optimizer=optimizer, opt_kwargs=dict(opt_kwargs, lr=lr), param_dtype=param_dtype,
               offload=offload, bucket_bytes=bucket_bytes, group=group)


def check_same_model(model, group=None):
    """Raise ValueError on every rank if the model's parameter shapes or values differ between
    ranks (a model built from different seeds would otherwise train silently wrong). The check is
    a few numbers per parameter tensor, reduced with MAX and MIN on the rank's device (NCCL
    reduces only GPU tensors)."""
    from zerolab.launch import rank_device
    with torch.no_grad():
        sig = torch.tensor([float(len(list(model.parameters())))]
                           + [float(sum(p.numel() for p in model.parameters()))]
                           + [float(p.double().sum()) for p in model.parameters()], dtype=torch.float64,
                           device=rank_device())
    n = torch.tensor([sig.numel()], dtype=torch.float64, device=rank_device())
    hi, lo = n.clone(), n.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    if hi.item() != lo.item():
        raise ValueError(f"the model differs across ranks: rank {dist.get_rank(group)} has "
                         f"{int(n.item()) - 2} parameter tensors, others have a different count")
    mx, mn = sig.clone(), sig.clone()
    dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(mn, op=dist.ReduceOp.MIN, group=group)
    if not torch.equal(mx, mn):
        names = [n for (n, _), a, b in zip(model.named_parameters(), mx[2:], mn[2:]) if a != b]
        raise ValueError(f"the model differs across ranks (different shapes or initial values; "
                         f"build it from the same seed on every rank): {names[:5] or 'sizes'}")

