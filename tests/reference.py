"""The tests' one single-process reference and one engine training loop (issue #26).

* :func:`batch`: the data, one deterministic batch per (model name, step, rank, micro-batch).
* :func:`reference`: ONE process, no communication, a plain torch optimizer on the global batch of
  each step, every rank's micro-batches concatenated. With a loss that is a mean over equal-size
  micro-batches, that is exactly what N ranks x M micro-batches of data parallelism compute (the
  mean over the global batch = the mean over ranks of the mean over micro-batches), so every stage
  must land on it: to ~1e-12 in float64, whatever the stage, N, buckets or offload.
* :func:`train`: the engine training loop, run on every rank (``cluster.run(train, ...)``).

Both return ``{name: tensor}`` for every state-dict name (``named_parameters(remove_duplicate=False)``:
both ends of a tied weight), as ``engine.full_state_dict()`` does, so results compare name by name
(``helpers.assert_params``). The reference imports nothing from zerolab but the models and their
data (:func:`train` is the only part that uses the engine): it is independent of the code under
test.
"""
import contextlib

import torch
import torch.distributed as dist

import zerolab
from zerolab import models

SIZE = 4        # samples per micro-batch per rank


# -- data ------------------------------------------------------------------------------------------
def batch(name, step, rank, micro=0, *, size=SIZE, dtype=torch.float64, model_kw=None):
    """The (inputs, targets) of ``rank``'s micro-batch ``micro`` at ``step``: ``size`` samples for
    ``models.build(name, **model_kw)`` (token ids for 'gpt', whatever ``dtype``; ``dtype`` values
    for 'mlp'). The same on every process that asks, without communication."""
    if not (0 <= micro < 10 and 0 <= rank < 100):
        raise ValueError(f"batch: micro-batch {micro} (0-9) or rank {rank} (0-99) out of range: "
                         f"seeds would collide")
    return models.batch(name, seed=1000 * step + 10 * rank + micro, batch_size=size, dtype=dtype,
                        **(model_kw or {}))


def _cat(parts):
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def rank_batch(name, step, rank, world_size, micro=0, *, shards=None, **data):
    """What ``rank`` of ``world_size`` computes on: its own :func:`batch`, or, with ``shards`` (a
    multiple of world_size), its shards/world_size consecutive data shards concatenated: then a
    step's data do not depend on the number of ranks (a checkpoint saved on N ranks, resumed on M,
    against ``reference(name, shards, ...)``)."""
    if shards is None:
        return batch(name, step, rank, micro, **data)
    if shards % world_size:
        raise ValueError(f"{shards} data shards do not split evenly over {world_size} ranks")
    per = shards // world_size
    return _cat([batch(name, step, j, micro, **data) for j in range(rank * per, (rank + 1) * per)])


def global_batch(name, step, world_size, micro=1, **data):
    """Every rank's ``micro`` micro-batches of ``step``, concatenated (rank-major)."""
    return _cat([batch(name, step, r, m, **data) for r in range(world_size) for m in range(micro)])


def build(name, dtype=torch.float64, *, model_kw=None, builder=None):
    """The model every process builds identically: ``models.build(name, seed=0, ...)``, or
    ``builder(dtype, **model_kw)`` for a model of the test's own (picklable: it runs on the ranks)."""
    if builder is not None:
        return builder(dtype, **(model_kw or {}))
    return models.build(name, seed=0, dtype=dtype, **(model_kw or {}))


# -- the single-process reference ------------------------------------------------------------------
def reference(name, world_size, steps, *, micro=1, dtype=torch.float64, param_dtype=None,
              optimizer=torch.optim.AdamW, lr, scheduler=None, stale=False, size=SIZE, model_kw=None,
              builder=None, **opt_kwargs):
    """ONE process trains ``name`` for ``steps`` steps on the global batch of ``world_size`` ranks x
    ``micro`` micro-batches, with ``optimizer(lr=lr, **opt_kwargs)`` over the trainable parameters
    (each tensor once: a tied weight is one parameter with the sum of both gradients). Returns
    {name: tensor} for every state-dict name.

    ``dtype``: float64 by default (the exact yardstick), or the dtype the engine trains in.
    ``param_dtype=torch.bfloat16``: mixed precision done by hand: the model computes in bf16, an
    fp32 master copy and the optimizer's state take the fp32 gradient (trained names return the
    master; frozen ones their bf16 value).
    ``scheduler``: ``scheduler(optimizer)`` -> an LR scheduler, stepped after every optimizer step.
    ``stale=True``: ZeRO-Offload's delayed parameter update (arXiv 2101.06840 Sec. 5.2), the
    gradient taken one update behind: p_t = p_{t-1} - u(g_t(p_{t-2})), p_{-1} = p_0. After
    ``steps - 1`` steps it returns what the device computes with after ``steps``.
    A trainable parameter that gets no gradient gets a zero one, as in every engine (and DeepSpeed;
    torch's optimizers would skip it, weight decay and Adam's moments included)."""
    mixed = param_dtype is not None
    model = build(name, torch.float32 if mixed else dtype, model_kw=model_kw, builder=builder)
    trainable = [p for p in model.parameters() if p.requires_grad]         # tied: once
    masters = [p.detach().clone() for p in trainable] if mixed else trainable
    opt = optimizer(masters, lr=lr, **opt_kwargs)
    sched = scheduler(opt) if scheduler is not None else None
    if mixed:
        model.to(param_dtype)
    behind = [m.detach().clone() for m in masters]          # stale: what the device computes on
    for step in range(steps):
        x, y = global_batch(name, step, world_size, micro, size=size, dtype=param_dtype or dtype,
                            model_kw=model_kw)
        newest = [m.detach().clone() for m in masters]
        if stale:
            with torch.no_grad():
                for p, q in zip(trainable, behind):
                    p.copy_(q)                              # the gradient at the one-update-old params
        model(x, y).backward()
        with torch.no_grad():
            if stale:
                for m, q in zip(masters, newest):
                    m.copy_(q)                              # the update applies to the newest params
            for m, p in zip(masters, trainable):
                grad = torch.zeros_like(p) if p.grad is None else p.grad
                if mixed:
                    m.grad, p.grad = grad.float(), None             # the master takes it in fp32
                else:
                    p.grad = grad                                   # p is its own master
            opt.step()
            opt.zero_grad()
            if mixed:
                for m, p in zip(masters, trainable):
                    p.copy_(m)                              # bf16 compute copy of the fp32 master
        if sched is not None:
            sched.step()
        behind = newest
    result = {id(p): m.detach().clone() for p, m in zip(trainable, masters)}
    return {n: result[id(p)] if id(p) in result else p.detach().clone()
            for n, p in model.named_parameters(remove_duplicate=False)}


# -- the engine training loop, on every rank -------------------------------------------------------
def run(engine, name, steps, *, micro=1, no_sync=True, dtype=torch.float64, size=SIZE, model_kw=None,
        shards=None, scheduler=None, before_step=None, after_step=None):
    """Train ``engine`` from its step ``engine.steps`` up to ``steps``: per step, ``micro``
    micro-batches of this rank's data (:func:`rank_batch`, in ``dtype``), each loss divided by
    ``micro``; with ``no_sync`` all but the last inside ``engine.no_sync()`` (DDP's idiom: one
    synchronisation per step), else every backward synchronises (accumulating into the gradient
    shard). Then step, zero_grad, and ``scheduler.step()`` (an LR scheduler instance).
    ``before_step(engine, step)``: called before a step's first forward; a value other than None
    ends training there and is returned (a rank that leaves early). ``after_step(engine, step)``:
    called after ``scheduler.step()``."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for step in range(engine.steps, steps):
        if before_step is not None:
            early = before_step(engine, step)
            if early is not None:
                return early
        for m in range(micro):
            x, y = rank_batch(name, step, rank, world_size, m, shards=shards, size=size, dtype=dtype,
                              model_kw=model_kw)
            last = m == micro - 1
            with engine.no_sync() if no_sync and not last else contextlib.nullcontext():
                engine.backward(engine(x, y) / micro)
        engine.step()
        engine.zero_grad()
        if scheduler is not None:
            scheduler.step()
        if after_step is not None:
            after_step(engine, step)
    return None


def train(name, steps, *, stage=0, offload=None, dtype=torch.float64, param_dtype=None,
          optimizer=torch.optim.AdamW, lr, model_kw=None, builder=None, delayed=False, scheduler=None,
          setup=None, finish=None, micro=1, no_sync=True, size=SIZE, shards=None, before_step=None,
          after_step=None, **options):
    """On every rank: build the model (:func:`build`), ``zerolab.initialize`` it with ``stage``,
    ``offload``, ``optimizer``, ``lr``, ``param_dtype`` and ``options`` (engine options such as
    ``bucket_bytes``, ``reduce_impl``, ``prefetch``, and the optimizer's own keywords), train it up
    to ``steps`` with :func:`run` (data in ``param_dtype or dtype``) and return
    ``engine.full_state_dict()``, or ``finish(engine)`` when given.
    ``delayed=True``: the delayed parameter update (offload). ``scheduler(engine.optimizer)``: an LR
    scheduler. ``setup(engine)``: called before training (say, loading a checkpoint)."""
    model = build(name, dtype, model_kw=model_kw, builder=builder)
    engine = zerolab.initialize(model, stage=stage, offload=offload, optimizer=optimizer, lr=lr,
                                param_dtype=param_dtype, **options)
    if delayed:
        engine.delayed_update = True
    if setup is not None:
        setup(engine)
    early = run(engine, name, steps, micro=micro, no_sync=no_sync, dtype=param_dtype or dtype, size=size,
                model_kw=model_kw, shards=shards,
                scheduler=scheduler(engine.optimizer) if scheduler is not None else None,
                before_step=before_step, after_step=after_step)
    if early is not None:
        return early
    return finish(engine) if finish is not None else engine.full_state_dict()
