"""Activations: what autograd keeps for backward, measured and predicted, and how to keep less.

ZeRO partitions model states; every tensor a forward saves for its backward stays whole on the rank
that computed it. Three tools, each measured in lesson 10:

* measure: :class:`SavedTensors`, a ``torch.autograd.graph.saved_tensors_hooks`` region that records
  every tensor autograd saves (by module, each storage once, parameters apart) without keeping any;
* predict: :func:`layer_terms` and :func:`activation_bytes_per_layer`, the closed form of Korthikanti
  et al., "Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198, Sec. 4),
  for a model's own shapes and dtypes, with or without dropout and a fused attention kernel;
* keep less: :func:`apply_checkpointing` (full recomputation of each block, or selective recomputation
  of each core attention, with ``torch.utils.checkpoint(use_reentrant=False)``; what the engines'
  ``activation_checkpointing`` option applies) and :class:`OffloadToHost` (``save_on_cpu`` that
  counts the bytes it moves).

Per transformer layer (s sequence length, b micro-batch, h hidden size, a heads), 16-bit activations
with dropout, the paper's Eq. (1): s·b·h·(34 + 5·a·s/h) bytes; full recomputation keeps only the
layer's input (2·s·b·h) and runs the forward again in backward (6 -> 8 FLOPs per parameter per
token); selective recomputation drops the 5·a·s²·b term of the attention core for a few FLOPs.
"""
from collections import namedtuple

import torch
from torch.utils.checkpoint import checkpoint

MODES = (None, "full", "selective")
# One tensor handed to a pack hook: where it was saved, its own bytes, its storage and that storage's
# bytes, whether it is a parameter (or buffer), and whether this storage was saved here for the first time.
Saved = namedtuple("Saved", "module shape dtype nbytes storage storage_bytes parameter first")


def _outer_hooks():
    """The saved-tensor hooks active right now (a user's ``save_on_cpu``, say), or None. Only the
    innermost pair of hooks runs, so a region that measures must hand each tensor on to them."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def _is_parameter(t):
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


def _storage_key(t):
    """(device type, device index, the storage object's address), its bytes. The storage object, not
    its data pointer: ZeRO-3 frees a unit's data and re-gathers it elsewhere while the storage object
    lives on, and a freed data address can be reused by a new activation."""
    st = t.untyped_storage()
    return (t.device.type, t.device.index, st._cdata), st.nbytes()


# -- measure ----------------------------------------------------------------------------------
class SavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Record every tensor autograd saves for backward inside the ``with`` block::

        with SavedTensors(model) as saved:
            loss = model(x, y)
        saved.total()          # bytes kept for backward (each storage once, parameters excluded)
        saved.by_module()      # {innermost module running when it was saved: bytes}

    A tensor is attributed to the innermost submodule of ``model`` whose forward was running when an
    op saved it ('' for the model's own code; 'blocks.0' for work in a block's own forward, such as
    TinyGPT's GeLU; ``per_module=False``: no module hooks, totals only). Counted by storage, first
    saver only: q, k and v, views of one qkv tensor, count that tensor once. Parameters (and views of
    them, such as ``weight.t()``) and the model's buffers are model states, not activations: recorded
    with ``parameter=True`` and left out of the totals.

    Nothing is kept: ``records`` holds one :data:`Saved` per tensor. Saved-tensor hooks already active
    outside (``save_on_cpu``, another ``SavedTensors``) still receive every tensor. Tensors saved
    inside a ``torch.utils.checkpoint`` region are the checkpoint's business (it installs its own
    hooks and keeps only the region's inputs, which ARE recorded here: what a checkpoint costs).
    """

    def __init__(self, model=None, *, per_module=True):
        self.model, self.per_module, self.records = model, per_module, []
        self._seen, self._stack, self._handles, self._outer, self._skip = set(), [""], [], None, set()
        super().__init__(self._pack, self._unpack)

    def __enter__(self):
        self._outer = _outer_hooks()
        if self.model is not None:
            self._skip = {_storage_key(b)[0] for b in self.model.buffers()}
            for name, module in self.model.named_modules() if self.per_module else ():
                if module is not self.model:
                    self._handles.append(module.register_forward_pre_hook(self._enter(name)))
                    self._handles.append(module.register_forward_hook(self._leave, always_call=True))
        super().__enter__()
        return self

    def __exit__(self, *exc):
        super().__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles = []

    def _enter(self, name):
        def hook(module, args):
            self._stack.append(name)
        return hook

    def _leave(self, module, args, output):
        self._stack.pop()

    def _pack(self, t):
        key, storage_bytes = _storage_key(t)
        parameter = _is_parameter(t) or key in self._skip
        first = not parameter and key not in self._seen
        if first:
            self._seen.add(key)      # saved tensors stay alive until backward: their keys stay theirs
        self.records.append(Saved(self._stack[-1], tuple(t.shape), t.dtype, t.numel() * t.element_size(), key,
                                  storage_bytes, parameter, first))
        return self._outer[0](t) if self._outer else t.detach()   # detach: no reference cycle

    def _unpack(self, packed):
        return self._outer[1](packed) if self._outer else packed

    def _activations(self):
        return [r for r in self.records if r.first]                 # first saver (never a parameter)

    def total(self):
        """Bytes of activations saved in the region: each storage once, parameters excluded."""
        return sum(r.storage_bytes for r in self._activations())

    def by_module(self, depth=None):
        """{module name: bytes} in the order modules first saved something; ``depth`` keeps only
        the first ``depth`` parts of each name ('blocks.0.qkv' -> 'blocks.0' with depth=2)."""
        out = {}
        for r in self._activations():
            name = ".".join(r.module.split(".")[:depth]) if depth else r.module
            out[name] = out.get(name, 0) + r.storage_bytes
        return out

    def by_device(self):
        """{device type: bytes} of the activations (the engine's ``activation_report``)."""
        out = {}
        for r in self._activations():
            out[r.storage[0]] = out.get(r.storage[0], 0) + r.storage_bytes
        return out

    def packed_bytes(self, parameters=False):
        """Bytes handed to the pack hook, every call counted with its own size (a view of a storage
        saved twice counts twice): what ``save_on_cpu`` copies to the host. ``parameters=True``:
        also the parameters (``save_on_cpu`` copies them too)."""
        return sum(r.nbytes for r in self.records if parameters or not r.parameter)


# -- predict: Korthikanti et al. 2022, Sec. 4.1, for a model's own shapes and dtypes ------------
def layer_terms(seq_len, micro_batch, d_model, n_heads, *, dtype_bytes=2, dropout=True, flash=False,
                mask_bytes=1, stats_bytes=0):
    """The activation bytes one transformer layer saves, term by term: [(term, saved by, bytes)].

    The paper's terms (Sec. 4.1), for s = ``seq_len``, b = ``micro_batch``, h = ``d_model``,
    a = ``n_heads``, e = ``dtype_bytes`` per element (the paper: e = 2, and 1-byte dropout masks):

    ===============================  ==================  ==========================================
    term                             bytes               saved by (TinyGPT's submodule)
    ===============================  ==================  ==========================================
    two LayerNorm inputs             2·e·sbh             ln1, ln2
    QKV projection input             e·sbh               qkv
    Q and K (for QK^T), V            3·e·sbh             core_attention
    softmax output                   e·a·s²·b            core_attention        (not with flash)
    attention dropout mask, output   (1 + e)·a·s²·b      core_attention        (dropout, not flash)
    output projection input          e·sbh               proj
    MLP input, GeLU input, output-   (1 + 4 + 4)·e·sbh   fc, the block (GeLU), out
    layer input
    dropout masks after attention    2·sbh               (dropout only)
    and MLP
    ===============================  ==================  ==========================================

    With e = 2 and dropout: 34·sbh + 5·a·s²·b, the paper's s·b·h·(34 + 5·a·s/h). Beyond the paper,
    measured on torch's kernels: ``flash=True`` (a fused kernel such as torch's
    scaled_dot_product_attention) saves, instead of the s² terms, its output and one fp32 logsumexp
    per row and head (4·a·s·b); the output is also the output projection's input (one tensor, saved
    first by the kernel: "saved by" core_attention);
    ``stats_bytes`` > 0 adds each LayerNorm's saved mean and 1/std (2 per token per LayerNorm:
    4·sb·stats_bytes; the paper leaves them out as small).
    """
    s, b, h, a, e = seq_len, micro_batch, d_model, n_heads, dtype_bytes
    sbh, s2 = s * b * h, a * s * s * b
    terms = [("LayerNorm inputs (2)", "ln1, ln2", 2 * e * sbh),
             ("QKV projection input", "qkv", e * sbh),
             ("Q, K and V", "core_attention", 3 * e * sbh),
             ("softmax output", "core_attention", 0 if flash else e * s2),
             ("attention dropout mask + output", "core_attention",
              (mask_bytes + e) * s2 if dropout and not flash else 0),
             ("flash kernel: logsumexp", "core_attention", 4 * a * s * b if flash else 0),
             ("output projection input", "core_attention" if flash else "proj", e * sbh),
             ("MLP input", "fc", e * sbh),
             ("GeLU input", "block", 4 * e * sbh),
             ("MLP output-layer input", "out", 4 * e * sbh),
             ("dropout masks (attention out, MLP out)", "-", 2 * mask_bytes * sbh if dropout else 0),
             ("LayerNorm mean and 1/std (2)", "ln1, ln2", 4 * s * b * stats_bytes)]
    return [t for t in terms if t[2]]


# The terms selective recomputation drops: everything the core attention saves besides its inputs.
_CORE_ONLY = ("softmax output", "attention dropout mask + output", "flash kernel: logsumexp")


def activation_bytes_per_layer(seq_len, micro_batch, d_model, n_heads, *, dtype_bytes=2, recompute=None,
                               flash=False, dropout=True):
    """Bytes one transformer layer keeps for backward at the end of forward (Korthikanti et al.,
    arXiv 2205.05198; see :func:`layer_terms`): the planner's activation model.

    ``recompute=None``: every term, s·b·h·(34 + 5·a·s/h) for 16-bit with dropout (Eq. 1);
    ``'selective'``: the core attention is recomputed, its s² terms are not kept: 34·s·b·h (Sec. 5);
    ``'full'``: only the layer's input, e·s·b·h (2·s·b·h in 16-bit, Sec. 5). During backward, full
    recomputation also holds ONE layer's recomputed working set (the ``recompute=None`` bytes) on
    top; selective, one layer's core attention. ``flash=True``: a fused attention kernel (no s² term);
    ``dropout=False``: a layer without dropout (TinyGPT). Checked against measurement in
    tests/test_activations.py and lesson 10 (TinyGPT, float32 and bfloat16)."""
    if recompute not in MODES:
        raise ValueError(f"recompute={recompute!r} is not supported: choose one of {MODES}")
    if recompute == "full":
        return dtype_bytes * seq_len * micro_batch * d_model
    terms = layer_terms(seq_len, micro_batch, d_model, n_heads, dtype_bytes=dtype_bytes, dropout=dropout,
                        flash=flash)
    return sum(b for name, _, b in terms if recompute is None or name not in _CORE_ONLY)


def flops_per_token(num_params, *, recompute=None, n_layers=0, seq_len=0, d_model=0):
    """Training FLOPs per token: 6Ψ (forward 2, backward 4 per parameter) for the matrix multiplies,
    plus the attention core's 12·L·s·h (QK^T and AV over all s x s pairs, as the naive kernel
    computes them: 4·s·h per layer in forward, twice that in backward) when the shapes are given.
    ``recompute='full'`` adds one more forward, 2Ψ + 4·L·s·h: 8Ψ instead of 6Ψ, +33% (Korthikanti et
    al. Sec. 5); ``'selective'`` only the core attention's forward, 4·L·s·h. ``num_params``: the
    parameters that multiply every token (the Linear weights, the output layer included; embeddings
    and norms do no matrix multiply). An upper bound for torch's non-reentrant checkpoint, which
    stops recomputing once the last tensor backward needs is back (``early_stop``): the last matmul
    of a region, whose output nothing inside the region saved, is not run again (lesson 10)."""
    if recompute not in MODES:
        raise ValueError(f"recompute={recompute!r} is not supported: choose one of {MODES}")
    attention = 4 * n_layers * seq_len * d_model             # one forward of every core attention
    extra = {None: 0, "selective": attention, "full": 2 * num_params + attention}[recompute]
    return 6 * num_params + 3 * attention + extra


def partitioned_checkpoint_bytes(n_layers, seq_len, micro_batch, d_model, *, tensor_parallel=1,
                                 dtype_bytes=2, cpu=False):
    """ZeRO-R's P_a (Rajbhandari et al., arXiv 1910.02054, Sec. 6.1), accounting: per rank, the bytes
    of the activation checkpoints (each layer's input, e·s·b·h) that full recomputation keeps,
    {'device': ..., 'host': ...}. Tensor (model) parallelism replicates each checkpoint on its
    ``tensor_parallel`` ranks; P_a keeps 1/``tensor_parallel`` of it per rank and all-gathers it back
    before the layer's recomputation; P_a+cpu (``cpu=True``) keeps that slice in host memory.
    Data-parallel ranks hold different samples, so with ``tensor_parallel=1`` nothing is replicated
    and P_a changes nothing."""
    total = n_layers * dtype_bytes * seq_len * micro_batch * d_model / tensor_parallel
    return {"device": 0 if cpu else total, "host": total if cpu else 0}


# -- keep less: checkpointing ----------------------------------------------------------------
class _Recomputed:
    """What a checkpointed module's ``forward`` becomes: its class's forward, run under
    ``torch.utils.checkpoint`` (non-reentrant) while gradients are on. A callable object, not a
    closure, so that ``copy.deepcopy(model)`` and pickling give a copy that calls its own forward."""

    def __init__(self, module):
        self.module = module

    def __call__(self, *args, **kwargs):
        forward = type(self.module).forward.__get__(self.module)
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        # Keeps the inputs (saved through the saved-tensor hooks, so they are measured), drops every
        # tensor the forward saves, and runs the forward again when backward first needs one of them.
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_regions(model, mode, units=None):
    """The modules ``mode`` checkpoints in ``model``, checked (ValueError naming the problem):
    ``'full'``: each of ``model.blocks`` (TinyGPT's), or ``units``; ``'selective'``: each block's
    ``core_attention`` (TinyGPT's), or ``units``, the modules that compute your model's attention
    core; None: nothing (and ``units`` must be None)."""
    if mode not in MODES:
        raise ValueError(f"activation_checkpointing={mode!r} is not supported: choose one of {MODES}")
    if mode is None:
        if units is not None:
            raise ValueError("checkpoint_units needs activation_checkpointing='full' or 'selective'")
        return []
    if units is None:
        blocks = getattr(model, "blocks", None)
        if not isinstance(blocks, torch.nn.ModuleList) or not len(blocks):
            raise ValueError(f"activation_checkpointing={mode!r}: this model has no `blocks` list to "
                             f"checkpoint; pass checkpoint_units=[the modules to recompute]")
        if mode == "full":
            return list(blocks)
        cores = [getattr(b, "core_attention", None) for b in blocks]
        if not all(isinstance(c, torch.nn.Module) for c in cores):
            raise ValueError("activation_checkpointing='selective' recomputes each block's core attention: "
                             "this model's blocks have no `core_attention` module; pass "
                             "checkpoint_units=[the modules computing softmax(QK^T)V]")
        return cores
    names = {id(m): n for n, m in model.named_modules()}
    regions = list(units)
    for m in regions:
        if not isinstance(m, torch.nn.Module) or id(m) not in names or m is model:
            raise ValueError(f"checkpoint_units must be submodules of the model (not the model itself), "
                             f"got {type(m).__name__}")
        if isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            raise ValueError(f"checkpoint unit {names[id(m)]!r} is a {type(m).__name__}: its forward never "
                             f"runs; list its members instead")
    for m in regions:
        inside = [names[id(o)] for o in regions if o is not m and any(o is d for d in m.modules())]
        if inside:
            raise ValueError(f"checkpoint unit {names[id(m)]!r} contains other checkpoint units {inside}: "
                             f"give disjoint modules")
    return regions


def apply_checkpointing(model, mode, units=None):
    """Make exactly the modules of :func:`checkpoint_regions` recompute their forward in backward
    (and no others: checkpointing left by an earlier call is removed); returns them. The modules are
    changed in place (their ``forward``); parameters and state-dict names are not."""
    regions = checkpoint_regions(model, mode, units)
    names = {id(m): n for n, m in model.named_modules()}
    for m in regions:
        if "forward" in vars(m) and not isinstance(vars(m)["forward"], _Recomputed):
            raise ValueError(f"module {names[id(m)]!r} has a forward of its own set on the instance; "
                             f"checkpointing would replace it")
    for m in model.modules():
        if isinstance(vars(m).get("forward"), _Recomputed):
            del m.forward
    for m in regions:
        m.forward = _Recomputed(m)
    return regions


# -- keep less: offload ---------------------------------------------------------------------
class OffloadToHost(torch.autograd.graph.saved_tensors_hooks):
    """``torch.autograd.graph.save_on_cpu`` that counts what it moves and leaves parameters alone.

    Every activation saved in the region is copied to host memory in forward (pinned, when a GPU is
    present and ``pin_memory``: page-locked memory is what lets ``copy_(non_blocking=True)`` run as
    an asynchronous DMA beside the compute; pageable memory makes each copy synchronous, staged
    through a driver buffer) and back to its device when backward needs it. ``bytes_to_host`` and
    ``bytes_to_device`` count those bytes (each saved tensor with its own size). Parameters (and
    views of them) stay where they are: they are model states, resident anyway, where torch's
    ``save_on_cpu`` copies them too. On a CPU-only machine host and device are the same memory: the
    counters say what WOULD cross the link; no copy is made."""

    def __init__(self, pin_memory=True):
        self.pin_memory = pin_memory
        self.bytes_to_host = self.bytes_to_device = self.kept_bytes = 0
        super().__init__(self._pack, self._unpack)

    def __enter__(self):
        super().__enter__()
        return self

    def _pack(self, t):
        if _is_parameter(t):
            self.kept_bytes += t.numel() * t.element_size()
            return None, t.detach()
        self.bytes_to_host += t.numel() * t.element_size()
        if t.device.type == "cpu":
            return t.device, t.detach()
        pinned = self.pin_memory and torch.cuda.is_available()
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pinned)
        host.copy_(t, non_blocking=pinned)
        return t.device, host

    def _unpack(self, packed):
        device, t = packed
        if device is None:
            return t
        self.bytes_to_device += t.numel() * t.element_size()
        return t.to(device, non_blocking=self.pin_memory)
