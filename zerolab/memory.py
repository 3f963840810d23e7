"""Where training memory goes: measured accounting of model states and activations, and the ZeRO
formulas that predict them.

Two halves, kept side by side so every lesson can set measurement beside theory:

* measured: :func:`model_states` (params / grads / optimizer state of a real model + optimizer),
  :func:`activation_bytes` (what autograd saves for backward, per layer), :func:`peak_memory`
  (what the operating system or the CUDA allocator saw), :func:`tensor_census` (every live tensor
  by device and dtype, found by walking the garbage collector's objects, not asked of an engine). Counting is by *storage*: tied weights,
  parameters that are views into a flat buffer and gradients that alias bucket buffers would
  otherwise be counted twice or more (:func:`storage_bytes_by_kind`).
* theory: :func:`model_state_bytes` / :func:`model_state_placement`, the per-rank model-state bytes
  of data parallelism and ZeRO stages 1-3 (Rajbhandari et al., arXiv 1910.02054, Sec. 5 / Fig. 1),
  with or without CPU offload (Ren et al., ZeRO-Offload, arXiv 2101.06840).
"""
import contextlib
import operator
import os
import resource
import sys
import time

import psutil
import torch

KINDS = ("params", "grads", "optimizer", "master")

# Bytes per element of each model state, per precision (ZeRO Sec. 3.1).
# Mixed precision: fp16/bf16 params and grads for compute; the optimizer keeps an fp32 master copy
# and Adam's momentum and variance in fp32: K = 4 + 4 + 4 = 12.
# Plain fp32 Adam: fp32 params and grads, the optimizer keeps momentum and variance: K = 4 + 4 = 8.
# Both add up to 16 bytes per parameter.
PRECISIONS = {True: {"param": 2, "grad": 2, "k": 12}, False: {"param": 4, "grad": 4, "k": 8}}


# ---------------------------------------------------------------------------------------------
# Measured: storages, model states, activations, process peaks
# ---------------------------------------------------------------------------------------------
def _storage_key(t):
    st = t.untyped_storage()
    return (st.device.type, st.device.index, st.data_ptr()), st.nbytes(), st.device.type


def storage_bytes_by_kind(tensors_by_kind):
    """Bytes per kind and device, counting each underlying storage once.

    ``tensors_by_kind``: {kind: iterable of tensors}. When one storage appears under several
    kinds, the first kind (in dict order) gets it. Returns {kind: {device_type: bytes}}.
    A view counts its whole storage (a flat buffer is counted once, at its full size).
    Meta tensors hold no memory and are skipped.
    """
    seen, out = set(), {}
    for kind, tensors in tensors_by_kind.items():
        per_device = out.setdefault(kind, {})
        for t in tensors:
            if t is None or t.device.type == "meta":
                continue
            key, nbytes, device = _storage_key(t)
            if nbytes == 0 or key in seen:
                continue
            seen.add(key)
            per_device[device] = per_device.get(device, 0) + nbytes
    return out


def _state_tensors(value):
    """Every tensor inside one optimizer-state entry (tensors, or lists/dicts of them)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _state_tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _state_tensors(v)


def model_states(model, optimizer=None):
    """Measured model-state bytes of a plain torch model (and optimizer) in THIS process.

    Returns {kind: {device_type: bytes}} with kinds, each storage counted once across all kinds:

    * ``"params"``: every parameter of ``model``, trainable or frozen (a frozen layer still
      occupies memory; it just gets no gradient and no optimizer state). Tied weights count once.
    * ``"grads"``: the ``.grad`` of each parameter that has one (``None`` for frozen parameters
      and before the first backward: 0 bytes), plus the grads of any optimizer-only parameters.
      Grads that are views into one bucket buffer (torch DDP's ``gradient_as_bucket_view``)
      count the buffer once.
    * ``"optimizer"``: everything the optimizer holds beyond the model: its state tensors (Adam's
      ``exp_avg``, ``exp_avg_sq`` and its small ``step`` counters; SGD's momentum) and any
      parameter it updates that is not one of the model's own (the fp32 master copies of mixed
      precision). This is the paper's K bytes/parameter. It appears at the first ``step()``.
      A wrapper holding its local optimizer in ``.optim`` (torch's ZeroRedundancyOptimizer,
      whose own ``.state`` stays empty) is looked through.

    Buffers (``model.buffers()``, e.g. BatchNorm statistics) are not model states in the paper's
    sense and are not counted. Nothing here is padded: see :func:`model_state_bytes` for padding.
    """
    params = list(model.parameters())
    own = {id(p) for p in params}
    extra, state = [], []
    optimizers = [] if optimizer is None else [optimizer]
    if isinstance(getattr(optimizer, "optim", None), torch.optim.Optimizer):
        optimizers.append(optimizer.optim)  # a wrapper's local optimizer (ZeroRedundancyOptimizer)
    for opt in optimizers:
        for group in opt.param_groups:
            extra += [p for p in group["params"] if id(p) not in own]  # e.g. fp32 master copies
        for per_param in opt.state.values():
            state += list(_state_tensors(per_param))
    grads = [p.grad for p in params + extra]
    return storage_bytes_by_kind({"params": params, "grads": grads, "optimizer": extra + state})


def live_tensor_bytes():
    """A census: bytes of EVERY tensor alive in this process, {device type: bytes}, each storage
    once (found through the garbage collector, after a collection). It knows nothing of the code
    that made them, so it measures what a library really keeps, whatever its own accounting says
    (wrapper subclasses such as FSDP2's DTensor are counted through the local tensor they hold).
    It counts your own tensors too (a batch, a loss): drop them first."""
    import gc
    gc.collect()
    seen, out = set(), {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor) or obj.device.type == "meta":   # type(): no __class__ tricks
            continue
        try:
            key, nbytes, device = _storage_key(obj)
        except (RuntimeError, NotImplementedError, TypeError):
            continue                      # a wrapper subclass without storage of its own
        if nbytes and key not in seen:
            seen.add(key)
            out[device] = out.get(device, 0) + nbytes
    return out


def _layers(model):
    """The top-level layers: direct children, with ModuleList / ModuleDict opened up (their own
    forward is never called; their members are the layers, e.g. ``blocks.0``, ``blocks.1``)."""
    for name, child in model.named_children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            for sub, grandchild in _layers(child):
                yield f"{name}.{sub}", grandchild
        else:
            yield name, child


OUTSIDE_LAYERS = "(outside layers)"


def activation_bytes(model, *inputs, **kwargs):
    """Bytes autograd saves for backward during one forward ``model(*inputs, **kwargs)``, per
    top-level layer, in the order the layers ran: {layer name: bytes}.

    Every tensor an autograd op saves passes through a ``torch.autograd.graph.saved_tensors_hooks``
    pack hook; it is attributed to the top-level layer running at that moment (work done in the
    model's own forward, e.g. adding embeddings or the loss, goes to ``"(outside layers)"``).
    Counted by storage, each once: a tensor saved by two ops (a layer's output that the next layer
    saves as its input) counts for the first layer that saved it; views (q, k, v split from one
    qkv tensor) count their whole storage. Parameters and buffers are excluded: autograd saves
    weights for backward too, but they are model states, counted by :func:`model_states`.

    These are the activations held at the end of forward, the peak of a plain training step's
    activation memory; backward frees them layer by layer. Temporaries freed inside forward are not
    included. The forward runs with grad enabled; its output is discarded (so is its graph).
    """
    layer_of_storage, totals = {}, {}
    skip = {_storage_key(t)[0] for t in list(model.parameters()) + list(model.buffers())}
    current = [OUTSIDE_LAYERS]

    def pack(t):
        key, nbytes, _ = _storage_key(t)
        if t.device.type != "meta" and nbytes and key not in skip and key not in layer_of_storage:
            layer_of_storage[key] = current[-1]
            totals[current[-1]] = totals.get(current[-1], 0) + nbytes
        return t

    def enter(name):
        def hook(module, args):
            current.append(name)
            totals.setdefault(name, 0)   # a layer that saves nothing still shows up, with 0
        return hook

    def leave(module, args, output):
        current.pop()

    handles = []
    for name, layer in _layers(model):
        handles.append(layer.register_forward_pre_hook(enter(name)))
        handles.append(layer.register_forward_hook(leave, always_call=True))
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(*inputs, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return totals


def peak_memory():
    """High-water marks of this process's memory, in bytes: {"cpu": ..., "cuda": ...}.

    * ``"cpu"``: peak resident set size (RSS) of the whole process since it started
      (``getrusage`` ``ru_maxrss``, and at least the current RSS). It includes everything
      resident: the Python interpreter, torch's own code and libraries (several hundred MB before
      any tensor exists), the CPU allocator's cached-but-free blocks, and all tensors. It never goes down, so a step's memory
      is the difference against a baseline taken before it, and only if the step set a new peak.
    * ``"cuda"`` (only when CUDA is initialised): ``torch.cuda.max_memory_allocated()``, the peak of
      bytes held by live tensors on the current GPU since the last
      ``torch.cuda.reset_peak_memory_stats()``. It EXCLUDES the caching allocator's reserved but
      unused blocks (``max_memory_reserved``), the CUDA context (hundreds of MB), cuBLAS/cuDNN
      workspaces and NCCL's buffers: ``nvidia-smi`` shows more.
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB
    # Linux updates its high-water mark lazily; a peak is never below the current RSS.
    out = {"cpu": max(peak, psutil.Process().memory_info().rss)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.max_memory_allocated()
    return out


def live_tensors():
    """Every tensor storage this process's Python objects can reach, found without asking any engine:
    {storage key: (device type, dtype, bytes)}, each storage once (views and aliases share a key).

    A census (issue 19): it walks ``gc.get_objects()`` for tensors (parameters, buffers, optimizer
    state, flat buffers, batches, anything held by a Python object), adds the ``.grad`` of each tensor
    that has one (autograd may keep a gradient that no Python object names yet), and skips storages
    freed to 0 bytes. Tensors only the C++ side holds (autograd's saved activations during a step)
    are not seen: take it between steps. The dtype is the first tensor's seen on that storage."""
    import gc
    import warnings
    out = {}

    def add(t):
        if t.device.type == "meta":
            return
        key, nbytes, device = _storage_key(t)
        if nbytes and key not in out:
            out[key] = (device, t.dtype, nbytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # isinstance() on deprecated module proxies warns
        tensors = [obj for obj in gc.get_objects() if _is_tensor(obj)]
    for t in tensors:
        add(t)
        if t.requires_grad and t.is_leaf and t.grad is not None:   # only leaves keep a .grad
            add(t.grad)
    return out


def _is_tensor(obj):
    try:
        return isinstance(obj, torch.Tensor)
    except ReferenceError:                       # a dead weak proxy
        return False


def tensor_census(exclude=None):
    """Bytes of live tensors by device and dtype: {(device type, dtype name): bytes}, measured by
    :func:`live_tensors`, leaving out the storages of ``exclude`` (an earlier :func:`live_tensors`,
    e.g. taken before the model was built, so that only what appeared since is counted). Independent
    of the engines' own accounting (``state_tensors``, ``memory_report``, ``placement`` by role)."""
    exclude = exclude or {}
    out = {}
    for key, (device, dtype, nbytes) in live_tensors().items():
        if key not in exclude:
            name = (device, str(dtype).replace("torch.", ""))
            out[name] = out.get(name, 0) + nbytes
    return dict(sorted(out.items()))


@contextlib.contextmanager
def _quiet_stderr_fd():
    """Silence file descriptor 2 (the profiler's C++ start/stop banners) for a moment."""
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


@contextlib.contextmanager
def allocation_trace():
    """Bytes of CPU tensor memory allocated inside the region, over time, measured by torch's
    profiler (``profile_memory=True``: every allocation and free of torch's CPU allocator made on
    this thread). The CPU counterpart of ``torch.cuda.max_memory_allocated``: live tensors only,
    no allocator caching, no interpreter; tensors that existed before the region are not included
    (start it before building the model to count everything). Yields a dict filled on exit::

        {"t": [perf_counter seconds of each event], "live": [bytes live after it, since the start],
         "peak": max(live), "end": bytes still live at the end}

    Times are ``time.perf_counter()`` values, so they line up with :mod:`zerolab.timeline` spans.
    The profiler slows the region down severalfold: time it in a separate run.

    Only this thread's events are seen, frees included: a tensor allocated here but freed on another
    thread stays counted as live to the end. That happens with gloo collectives, whose worker thread
    can drop the last reference to a collective's buffers after the caller has dropped its own,
    depending on which gets there first. So on ranks a trace can overcount, by a different amount
    from run to run: compare its ``end`` with the growth of :func:`live_tensor_bytes` over the same
    region, which finds every tensor still alive (``tests/test_memory.py`` shows the missed free;
    torch 2.13's profiler, asked to profile all threads, records no memory events at all).
    """
    from torch.profiler import ProfilerActivity, profile
    out = {}
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr_fd():
        prof.__enter__()
    wall0, perf0 = time.time_ns(), time.perf_counter()   # the profiler stamps events in wall-clock ns
    try:
        yield out
    finally:
        with _quiet_stderr_fd():
            prof.__exit__(None, None, None)
        events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
        live, ts, lives = 0, [], []
        for ns, nbytes in events:
            live += nbytes
            ts.append((ns - wall0) / 1e9 + perf0)
            lives.append(live)
        out.update(t=ts, live=lives, peak=max(lives, default=0), end=live)


# ---------------------------------------------------------------------------------------------
# Theory: the ZeRO formulas (arXiv 1910.02054, Sec. 5.1 and Fig. 1) and ZeRO-Offload's split
# ---------------------------------------------------------------------------------------------
def _count(name, value, minimum):
    """An integer count (7.5e9 and numpy integers accepted) >= minimum, else ValueError."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return number


def _div(numerator, n):
    """numerator / n, as an int when exact (so 7.5e9 params on 64 ranks stay exact integers)."""
    return numerator // n if numerator % n == 0 else numerator / n


def model_state_placement(num_params, world_size, stage, *, mixed_precision=True, offload=False,
                          k=None, padded=False):
    """Per-rank model-state bytes split by where they live:
    {"device": {"params", "grads", "optimizer"}, "host": {"params", "grads", "optimizer"}}.

    ZeRO (Rajbhandari et al. 2020, Sec. 5.1 and Fig. 1), Ψ = ``num_params``, N = ``world_size``,
    K = optimizer bytes/param (12 for mixed-precision Adam, or ``k``), mixed precision:

    ======================  ===========  ===========  ==========  ====================
    stage                   params       grads        optimizer   total
    ======================  ===========  ===========  ==========  ====================
    0 (DP, replicated)      2Ψ           2Ψ           KΨ          (2 + 2 + K)Ψ
    1 (P_os)                2Ψ           2Ψ           KΨ/N        4Ψ + KΨ/N
    2 (P_os+g)              2Ψ           2Ψ/N         KΨ/N        2Ψ + (2 + K)Ψ/N
    3 (P_os+g+p)            2Ψ/N         2Ψ/N         KΨ/N        (4 + K)Ψ/N
    ======================  ===========  ===========  ==========  ====================

    ``mixed_precision=False``: the same Adam in fp32 throughout (lesson 01, section 3).

    ``offload=True`` (ZeRO-Offload, Ren et al. 2021, Sec. 4): the placement zerolab's offload
    engines realise (``zerolab.offload``): each rank's share of the model states split between
    its device and host memory, as lesson 06 (section 4) measures it stage by stage. Offload needs
    a sharded optimizer: stage >= 1. Transient buffers (gradient buckets, gathered ZeRO-3 layers)
    are not model states and are not counted, as in the paper.

    Exactness: with ``padded=False`` these are the paper's ideal numbers, exact per rank when N
    divides Ψ (returned as ints), fractional otherwise (floats). Real engines pad each flat buffer
    to a multiple of N (``zerolab.flat.FlatParams``, as DeepSpeed does): with ``padded=True`` every
    Ψ/N becomes ceil(Ψ/N) elements and every full-size buffer of stages 1-3 N·ceil(Ψ/N), i.e. at
    most N - 1 zero elements more per buffer (one flat buffer per kind assumed; each extra buffer,
    e.g. one per dtype, pads on its own). Stage 0 is never padded.
    """
    num_params = _count("num_params", num_params, 0)
    n = _count("world_size", world_size, 1)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if mixed_precision not in (True, False):
        raise ValueError(f"mixed_precision must be True or False, got {mixed_precision!r}")
    if offload not in (True, False):
        raise ValueError(f"offload must be True or False, got {offload!r}")
    if offload and stage == 0:
        raise ValueError("offload=True needs a sharded optimizer: stage 1, 2 or 3 (ZeRO-Offload "
                         "moves each rank's optimizer partition to the host); got stage 0")
    bytes_ = PRECISIONS[mixed_precision]
    k = bytes_["k"] if k is None else _count("k", k, 0)
    b_param, b_grad = bytes_["param"], bytes_["grad"]

    # Elements this rank stores of a full (replicated) and of a sharded state.
    if padded and stage > 0:
        shard = -(-num_params // n)                          # ceil(Ψ / N)
        full, part = (lambda b: b * shard * n), (lambda b: b * shard)
    else:
        full, part = (lambda b: b * num_params), (lambda b: _div(b * num_params, n))

    # ZeRO Sec. 5.1: which states are partitioned at each stage.
    params = part(b_param) if stage >= 3 else full(b_param)   # P_p: stage 3
    grads = part(b_grad) if stage >= 2 else full(b_grad)      # P_g: stages 2 and 3
    optim = part(k) if stage >= 1 else full(k)                # P_os: stages 1, 2, 3
    device = {"params": params, "grads": grads, "optimizer": optim}
    host = {"params": 0, "grads": 0, "optimizer": 0}
    if offload:
        # ZeRO-Offload Sec. 4.1: grad shard + optimizer state (+ update) live on the host.
        host["grads"] = part(b_grad)
        host["optimizer"] = part(k) if mixed_precision else part(k + 4)  # fp32: host param copy
        device["optimizer"] = 0
        if stage >= 2:
            device["grads"] = 0      # reduced shard goes straight to the host during backward
    return {"device": device, "host": host}


def model_state_bytes(num_params, world_size, stage, *, mixed_precision=True, offload=False,
                      k=None, padded=False):
    """Per-rank model-state bytes predicted by ZeRO (arXiv 1910.02054):
    {"params", "grads", "optimizer", "total": bytes on the DEVICE of one rank, "host": bytes on the
    host of one rank (0 unless ``offload``)}.

    DP (stage 0) (2+2+K)Ψ; stage 1 4Ψ + KΨ/N; stage 2 2Ψ + (2+K)Ψ/N; stage 3 (4+K)Ψ/N, with K = 12
    for mixed-precision Adam (fp32 master + momentum + variance) and 2-byte params and grads;
    ``mixed_precision=False`` is the same Adam in fp32 throughout.
    The paper's example, Ψ = 7.5e9 on N = 64: 120, 31.4, 16.6 and 1.88 GB (GB = 1e9 bytes).
    See :func:`model_state_placement` for offload, exactness and padding.
    """
    split = model_state_placement(num_params, world_size, stage, mixed_precision=mixed_precision,
                                  offload=offload, k=k, padded=padded)
    out = dict(split["device"])
    out["total"] = sum(split["device"].values())
    out["host"] = sum(split["host"].values())
    return out


def optimizer_k(optimizer="adam", *, mixed_precision=True):
    """K, optimizer-state bytes per parameter: Adam/AdamW m + v (8), SGD with momentum (4), plain
    SGD (0), plus the fp32 master copy (4) in mixed precision (ZeRO Sec. 3.1 uses Adam: K = 12)."""
    per_param = {"adam": 8, "adamw": 8, "sgd-momentum": 4, "sgd": 0}
    if optimizer not in per_param:
        raise ValueError(f"optimizer={optimizer!r} is not known: choose one of {sorted(per_param)}")
    return per_param[optimizer] + (4 if mixed_precision else 0)
