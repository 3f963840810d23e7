"""Pipeline parallelism: the model cut into p stages on p ranks, micro-batches passed by send/recv.

Rank s of the pipeline group holds stage s (a run of consecutive layers). A step's batch is cut
into m micro-batches; each goes forward through stages 0 .. p-1 (stage s sends its output, one
(b, seq, h) activation, to stage s+1) and backward through p-1 .. 0 (stage s sends the gradient of its input back).
Gradients accumulate over the micro-batches, then every stage steps its own parameters: the same
update as one process on the whole batch, with the loss averaged over micro-batches.

Two schedules, same bubble, different memory (Narayanan et al., *Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM*, SC21, arXiv 2104.04473, Sec. 2.2):

========  ===========================================  ==========================  ===================
schedule  order on stage s                             idle fraction of the step   micro-batches held
========  ===========================================  ==========================  ===================
GPipe     all m forwards, then all m backwards          (p-1)/(m+p-1)               m
1F1B      p-s-1 forwards, then one forward + one        (p-1)/(m+p-1)               min(p-s, m)
          backward in turn, then the last backwards
========  ===========================================  ==========================  ===================

(GPipe: Huang et al. 2019, arXiv 1811.06965. 1F1B, "PipeDream-Flush": Narayanan et al. 2021; it is
Megatron-LM's ``forward_backward_pipelining_without_interleaving`` in
megatron/core/pipeline_parallel/schedules.py, DeepSpeed's ``TrainSchedule`` in
deepspeed/runtime/pipe/schedule.py ("synchronous 1F1B"), and torch's ``Schedule1F1B``, which warms up with p - s forwards
and then runs one backward before each forward: the same bound on what a stage holds.)

A stage's activations live from its forward of a micro-batch to its backward of it, so the number of
micro-batches in flight is what 1F1B bounds: :class:`LiveActivations` measures the bytes autograd
holds, :class:`StageRun` counts micro-batches in flight and records each forward and backward as a
span on the active timeline (``comm.log(timeline=...)``) and waits for a neighbour as "wait" spans.
Sends are asynchronous (``comm.isend``): stage s may send forward while stage s+1 sends backward,
and a blocking send on both sides could wait forever (Megatron-LM batches each pair of send and
receive; torch fires them together too).
"""
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from zerolab import comm

SCHEDULES = ("gpipe", "1f1b")


class Stage(nn.Module):
    """Stage ``s`` of ``p`` of a :class:`zerolab.models.TinyGPT` (built the same on every rank): its
    ``n_layers / p`` consecutive blocks; stage 0 also embeds the tokens, the last stage also applies
    the final LayerNorm and the output layer. An untied model only (a tied embedding and head would
    live on two stages and need their gradients summed, Megatron-LM's embedding group).
    ``full_names``: {name here: name in the full model}."""

    def __init__(self, model, p, s):
        super().__init__()
        layers = len(model.blocks)
        if not (isinstance(p, int) and p >= 1 and layers % p == 0):
            raise ValueError(f"p={p!r}: the number of stages must divide the model's {layers} blocks")
        if not (isinstance(s, int) and 0 <= s < p):
            raise ValueError(f"s={s!r}: a stage index is in range({p})")
        if model.head.weight is model.tok.weight and p > 1:
            raise ValueError("Stage: the model ties its output layer to its embedding (tied=True); build it "
                             "with tied=False for a pipeline")
        self.p, self.s, self.first, self.last = p, s, s == 0, s == p - 1
        per = layers // p
        self.blocks = nn.ModuleList(model.blocks[s * per:(s + 1) * per])
        names = {f"blocks.{j}": f"blocks.{s * per + j}" for j in range(per)}
        if self.first:
            self.tok, self.pos = model.tok, model.pos
            names.update(tok="tok", pos="pos")
        if self.last:
            self.ln_f, self.head = model.ln_f, model.head
            names.update(ln_f="ln_f", head="head")
        self.full_names = {}
        for name, _ in self.named_parameters():
            prefix, _, rest = name.partition(".")
            key = prefix if prefix in names else ".".join(name.split(".")[:2])
            self.full_names[name] = names[key] + name[len(key):]

    def forward(self, x):                     # stage 0: token ids (b, s); else (b, s, h)
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


class _Sleep(torch.autograd.Function):
    """Identity on the values; forward sleeps ``forward_s``, backward ``backward_s``."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class EmulatedStage(nn.Module):
    """A pipeline stage whose compute is EMULATED: its forward sleeps ``forward_s`` seconds and its
    backward ``backward_s``, and passes the values through (times a parameter of 1, so that every
    stage, the first included, has a backward to run). For measuring what a schedule's dependencies
    cost in idle time on a machine with fewer cores than ranks: a sleeping rank needs no core, so the
    ranks' "compute" does not queue for the machine's cores and the wait for a neighbour is the
    schedule's own. The sends and receives between stages stay real."""

    def __init__(self, forward_s, backward_s):
        super().__init__()
        if not (forward_s >= 0 and backward_s >= 0):
            raise ValueError(f"forward_s={forward_s!r}, backward_s={backward_s!r}: sleeps are seconds >= 0")
        self.forward_s, self.backward_s = forward_s, backward_s
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return _Sleep.apply(x * self.weight, self.forward_s, self.backward_s)


def gpt_loss(logits, targets):
    """Cross-entropy of next-token logits (b, s, vocab) against targets (b, s): TinyGPT's loss."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class LiveActivations(torch.autograd.graph.saved_tensors_hooks):
    """The bytes autograd holds for backward right now (``live``) and the most it held (``peak``):
    each storage counted once while any saved tensor refers to it, parameters left out. A tensor
    leaves the count when autograd lets go of it (after the backward that used it), so on a
    pipeline stage ``live`` rises with every micro-batch's forward and falls with its backward."""

    def __init__(self):
        self.live = self.peak = 0
        self._refs = {}
        super().__init__(self._pack, self._unpack)

    def __enter__(self):
        super().__enter__()
        return self

    def _pack(self, t):
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t.detach()
        storage = t.untyped_storage()
        key = (t.device.type, t.device.index, storage.data_ptr())
        count, nbytes = self._refs.get(key, (0, storage.nbytes()))
        if count == 0:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self._refs[key] = (count + 1, nbytes)
        held = _Held(t.detach())
        weakref.finalize(held, self._release, key)
        return held

    @staticmethod
    def _unpack(held):
        return held.t if isinstance(held, _Held) else held

    def _release(self, key):
        count, nbytes = self._refs[key]
        if count == 1:
            del self._refs[key]
            self.live -= nbytes
        else:
            self._refs[key] = (count - 1, nbytes)


class _Held:
    """A saved tensor, as autograd keeps it (its lifetime is the saved tensor's)."""
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


class StageRun:
    """One step of one pipeline stage: ``forward(k)`` and ``backward(k)`` of micro-batch k, with the
    point-to-point traffic each needs, in whatever order a schedule calls them.

    This rank is stage i. ``forward(k)``: stage 0 takes ``inputs[k]``, the others receive their input
    from stage i-1; the last stage computes ``loss_fn(output, targets[k]) / m`` (the mean over
    micro-batches), the others send their output to stage i+1. ``backward(k)``: the last stage
    backpropagates its loss, the others receive the gradient of their output from stage i+1; every
    stage but the first sends its input's gradient to stage i-1. ``call`` (default: the stage) runs
    the forward, ``backward_fn(scalar, last)`` the backward (default: autograd); an engine
    (``zerolab.initialize``) plugs in there, and for it a non-last stage backpropagates the scalar
    sum(output * its gradient), whose gradient with respect to the output is exactly the received
    one. ``last`` is True for the stage's final backward of the step (where data parallelism
    synchronises).

    Afterwards: ``losses`` (the last stage's, one per micro-batch, not divided by m), ``order``
    ([("F" or "B", k)] as run), ``in_flight`` (after each call) and ``peak_in_flight``,
    ``activations`` (a :class:`LiveActivations`: bytes autograd held, after each call in
    ``activation_trace``)."""

    def __init__(self, stage, m, *, inputs=None, targets=None, loss_fn=gpt_loss, shape=None, dtype=None,
                 group=None, call=None, backward_fn=None):
        self.group = group
        self.s, self.p = dist.get_rank(group), dist.get_world_size(group)
        self.first, self.last = self.s == 0, self.s == self.p - 1
        if self.first and (inputs is None or len(inputs) != m):
            raise ValueError(f"stage 0 needs inputs: a list of m={m} micro-batches")
        if self.last and (targets is None or len(targets) != m):
            raise ValueError(f"the last stage needs targets: a list of m={m} micro-batches' targets")
        if not (self.first and self.last) and (shape is None or dtype is None):
            raise ValueError("shape and dtype of the activations passed between stages are needed to receive them")
        if getattr(call, "stage", None) == 3 and self.p > 1 and m > 1:
            raise ValueError("a ZeRO-3 engine (zerolab.initialize(..., stage=3)) gathers and frees each unit around "
                             "ONE micro-batch's forward and backward, and a pipeline keeps several in flight: use "
                             "stage 1 (DeepSpeed's pipeline engine allows no other) or stage 2")
        self.stage, self.m, self.inputs, self.targets, self.loss_fn = stage, m, inputs, targets, loss_fn
        self.shape, self.dtype = tuple(shape) if shape is not None else None, dtype
        self.call = call or stage
        self.backward_fn = backward_fn
        self.held = {}                  # micro-batch -> (its input, its output or loss): in flight
        self.sends = []                 # (handle, tensor) of asynchronous sends not yet waited on
        self.losses, self.order, self.in_flight, self.activation_trace = [], [], [], []
        self.peak_in_flight, self.backwards = 0, 0
        self.activations = LiveActivations()

    def _recv(self, src, what):
        buf = torch.empty(self.shape, dtype=self.dtype)
        with comm.span(what, "wait"):                 # idle until the neighbour's tensor is here
            comm.irecv(buf, src, self.group).wait()
        return buf

    def _send(self, tensor, dst):
        tensor = tensor.detach().contiguous()
        self.sends.append((comm.isend(tensor, dst, self.group), tensor))

    def _note(self, op, k):
        self.order.append((op, k))
        self.in_flight.append(len(self.held))
        self.peak_in_flight = max(self.peak_in_flight, len(self.held))
        self.activation_trace.append(self.activations.live)

    def forward(self, k):
        x = self.inputs[k] if self.first else self._recv(self.s - 1, f"recv F{k}").requires_grad_()
        with self.activations, comm.span(f"F{k}", "compute"):
            out = self.call(x)
            if self.last:
                loss = self.loss_fn(out, self.targets[k])
                self.losses.append(loss.detach())
                out = loss / self.m           # the step's loss: the mean over micro-batches
        if not self.last:
            self._send(out, self.s + 1)
        self.held[k] = (x, out)
        self._note("F", k)

    def backward(self, k):
        x, out = self.held.pop(k)
        grad = None if self.last else self._recv(self.s + 1, f"recv B{k}")
        self.backwards += 1
        with comm.span(f"B{k}", "compute"):
            if self.backward_fn is None:
                torch.autograd.backward(out, grad)
            else:
                scalar = out if self.last else (out * grad).sum()
                self.backward_fn(scalar, self.backwards == self.m)
        if not self.first:
            self._send(x.grad, self.s - 1)
        del x, out
        self._note("B", k)

    def finish(self):
        """Wait for every send; returns the last stage's losses (a list of floats), [] elsewhere."""
        for handle, _ in self.sends:
            handle.wait()
        self.sends = []
        return [float(v) for v in self.losses]


def gpipe(run):
    """GPipe (Huang et al. 2019): every forward, then every backward, in micro-batch order (as
    torch's ``ScheduleGPipe``). The stage holds all m micro-batches' activations at once."""
    for k in range(run.m):
        run.forward(k)
    for k in range(run.m):
        run.backward(k)
    return run.finish()


def one_f_one_b(run):
    """1F1B (PipeDream-Flush, Narayanan et al. 2021, Sec. 2.2.1): see the module docstring; the
    schedule exercise 14.1 asks you to write, so its body is not shown in the lesson."""
    warmup = min(run.p - run.s - 1, run.m)
    for k in range(warmup):
        run.forward(k)
    for k in range(run.m - warmup):
        run.forward(warmup + k)
        run.backward(k)
    for k in range(run.m - warmup, run.m):
        run.backward(k)
    return run.finish()


def train_step(stage, m, schedule, **kwargs):
    """Run ``schedule`` ("gpipe" or "1f1b") for one step of this rank's ``stage`` with m
    micro-batches (the keywords of :class:`StageRun`); returns the finished :class:`StageRun`."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not known: choose one of {list(SCHEDULES)}")
    run = StageRun(stage, m, **kwargs)
    {"gpipe": gpipe, "1f1b": one_f_one_b}[schedule](run)
    return run


def simulate(orders, *, forward=1.0, backward=2.0):
    """The timeline a list of per-stage orders ([("F" or "B", k)], stage 0 first) would take if each
    forward took ``forward`` and each backward ``backward`` time units, with a stage's forward of k
    waiting for stage s-1's and its backward of k for stage s+1's (communication free): {"end":
    makespan, "busy": per stage, "bubble": 1 - busy / makespan per stage, "spans": per stage
    [(op, k, start, end)]}. Accounting from an order, not a measurement: what a schedule would do on
    p identical devices. Raises ValueError for an order that would wait forever."""
    p = len(orders)
    done, spans = {}, [[] for _ in range(p)]
    clock, pos = [0.0] * p, [0] * p
    total = sum(len(o) for o in orders)
    while sum(pos) < total:
        moved = False
        for s in range(p):
            if pos[s] == len(orders[s]):
                continue
            op, k = orders[s][pos[s]]
            deps = [("F", s, k)] if op == "B" else []
            if op == "F" and s > 0:
                deps.append(("F", s - 1, k))
            if op == "B" and s < p - 1:
                deps.append(("B", s + 1, k))
            if any(d not in done for d in deps):
                continue
            start = max([clock[s]] + [done[d] for d in deps])
            end = start + (forward if op == "F" else backward)
            done[(op, s, k)] = clock[s] = end
            spans[s].append((op, k, start, end))
            pos[s] += 1
            moved = True
        if not moved:
            raise ValueError(f"these orders wait forever: stage positions {pos} can never run")
    end = max(clock)
    busy = [sum(e - b for _, _, b, e in sp) for sp in spans]
    return {"end": end, "busy": busy, "bubble": [1 - b / end for b in busy], "spans": spans}


def orders(schedule, p, m):
    """The per-stage orders a schedule runs (by :func:`simulate`'s convention), read from the
    schedule functions themselves on a stand-in that only records calls."""
    out = []
    for s in range(p):
        rec = _Recorder(p, s, m)
        {"gpipe": gpipe, "1f1b": one_f_one_b}[schedule](rec)
        out.append(rec.order)
    return out


class _Recorder:
    """Stands in for a :class:`StageRun`: records the calls a schedule makes, runs nothing."""

    def __init__(self, p, s, m):
        self.p, self.s, self.m, self.order = p, s, m, []

    def forward(self, k):
        self.order.append(("F", k))

    def backward(self, k):
        self.order.append(("B", k))

    def finish(self):
        return []


def plot_schedule(sim, ax=None, *, title=None, colors=None):
    """Draw :func:`simulate`'s timeline: one row per stage (stage 0 on top), each forward and backward
    a bar labelled with its micro-batch, the idle time left blank. Time in the units given to
    simulate (accounting, not a measurement). Returns ``ax``."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = colors or {"F": "tab:blue", "B": "tab:orange"}
    spans = sim["spans"]
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 + 0.5 * len(spans)))
    p = len(spans)
    for stage, row in enumerate(spans):
        y = p - 1 - stage
        for op, k, start, end in row:
            ax.broken_barh([(start, end - start)], (y + 0.1, 0.8), facecolors=colors[op], edgecolors="black",
                           linewidth=0.4)
            ax.text((start + end) / 2, y + 0.5, str(k), ha="center", va="center", fontsize=7,
                    color="white" if op == "F" else "black")
    ax.set_yticks([p - 1 - i + 0.5 for i in range(p)], [f"stage {i}" for i in range(p)])
    ax.set_xlim(0, sim["end"])
    ax.set_ylim(0, p)
    ax.set_xlabel("time (a forward = 1 unit, a backward = 2)")
    ax.legend(handles=[Patch(color=colors["F"], label="forward"), Patch(color=colors["B"], label="backward")],
              loc="upper right", fontsize=7, ncol=2)
    if title:
        ax.set_title(title)
    return ax
