"""Wrong: the replay that picks the stages' orders runs a forward before a backward that could start
at the same time: the backwards that free stage 0's slots wait behind new forwards.

Caught by: test_capped_step_is_as_fast_as_the_cap_allows."""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zerolab import comm


# -- 14.1: a pipeline step when each stage may hold at most `cap` micro-batches --------------------
def _orders(p, m, cap, forward=1.0, backward=2.0):
    """Every stage's order, from a replay of the pipeline on identical stages: whenever a stage is
    free it starts the op that can start earliest, a backward first on a tie (it frees a slot, and
    the stages upstream wait for it), a forward only while fewer than `cap` are in flight.
    Deterministic, so every rank computes the same orders without talking to the others."""
    done, free = {}, [0.0] * p
    nf, nb = [0] * p, [0] * p                       # forwards / backwards run so far, per stage
    orders = [[] for _ in range(p)]
    for _ in range(2 * m * p):
        best = None
        for i in range(p):
            for op in ("B", "F"):
                if op == "F" and (nf[i] == m or nf[i] - nb[i] == cap):
                    continue
                if op == "B" and nb[i] == nf[i]:
                    continue
                k = nf[i] if op == "F" else nb[i]
                if op == "F":
                    dep = ("F", i - 1, k) if i > 0 else None
                else:
                    dep = ("B", i + 1, k) if i < p - 1 else ("F", i, k)
                if dep is not None and dep not in done:
                    continue
                start = max(free[i], done[dep] if dep else 0.0)
                key = (start, op == "B", i)
                if best is None or key < best[0]:
                    best = (key, i, op, k)
        (start, _, _), i, op, k = best
        end = start + (forward if op == "F" else backward)
        done[(op, i, k)] = free[i] = end
        if op == "F":
            nf[i] += 1
        else:
            nb[i] += 1
        orders[i].append((op, k))
    return orders


def capped_pipeline_step(stage, m, cap, *, inputs=None, targets=None, loss_fn=None, shape=None, dtype=None,
                         group=None):
    if not (isinstance(cap, int) and cap >= 1):
        raise ValueError(f"cap={cap!r}: the micro-batches a stage may hold is an int >= 1")
    i, p = dist.get_rank(group), dist.get_world_size(group)
    first, last = i == 0, i == p - 1
    held, losses = {}, []
    sends = {}                                     # ("F" or "B", k) -> (handle, tensor) until waited

    def forward(k):
        if first:
            x = inputs[k]
        else:
            x = torch.empty(shape, dtype=dtype)
            comm.irecv(x, i - 1, group).wait()      # micro-batch k's activation from stage i-1
            x.requires_grad_()
        out = stage(x)
        if last:
            loss = loss_fn(out, targets[k])
            losses.append(float(loss))
            out = loss / m                          # the step's loss: the mean over micro-batches
        else:
            buf = out.detach().contiguous()
            sends[("F", k)] = (comm.isend(buf, i + 1, group), buf)   # never block on a send: the
        held[k] = (x, out)                          # neighbour may be sending to us right now

    def backward(k):
        x, out = held.pop(k)
        if last:
            out.backward()
        else:
            grad = torch.empty(shape, dtype=dtype)
            comm.irecv(grad, i + 1, group).wait()
            out.backward(grad)
            # stage i+1 has run micro-batch k's backward, so it received our activation long ago
            sends.pop(("F", k))[0].wait()
        for key in [key for key in sends if key[0] == "B"]:
            sends.pop(key)[0].wait()                # the previous gradient: stage i-1 has it by now
        if not first:
            g = x.grad.contiguous()
            sends[("B", k)] = (comm.isend(g, i - 1, group), g)

    for op, k in _orders(p, m, cap)[i]:
        forward(k) if op == "F" else backward(k)
    for handle, _ in sends.values():
        handle.wait()
    return losses


def capped_bubble(p, m, cap):
    for name, v in (("p", p), ("m", m), ("cap", cap)):
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise ValueError(f"{name}={v!r}: p, m and cap are ints >= 1")
    # Stage 0 can start micro-batch j + k only once micro-batch j's round trip (forward through all p
    # stages, backward through all p) is over. With k = min(cap, p) slots, the m micro-batches go in
    # ceil(m/k) groups; every group after the first waits (p - k) more slots than 1F1B's (m + p - 1).
    k = min(cap, p)
    slots = m + p - 1 + (p - k) * (math.ceil(m / k) - 1)
    return (slots - m) / slots


# -- 14.2: a sequence-parallel MLP block -----------------------------------------------------------
def _gather(x, group):
    t = dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty((x.shape[0] * t,) + tuple(x.shape[1:]), dtype=x.dtype)
    comm.all_gather(out, x, group=group)          # (t-1)/t of the (s, b, h) tensor sent
    return out


def _scatter(x, group):
    t = dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty((x.shape[0] // t,) + tuple(x.shape[1:]), dtype=x.dtype)
    comm.reduce_scatter(out, x, group=group)      # the sum's slice; (t-1)/t sent by a ring
    return out


class _GatherLinear(torch.autograd.Function):
    """All-gather the sequence slices, multiply by this rank's rows; keep only the slice for backward
    and gather it again there for the weight gradient (every saved activation is then 1/t)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group = group
        ctx.save_for_backward(x, weight)
        return F.linear(_gather(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        whole = _gather(x, ctx.group)                                  # the re-gather
        grad_x = _scatter(grad.matmul(weight), ctx.group)              # every rank's part, summed
        g2, x2 = grad.reshape(-1, grad.shape[-1]), whole.reshape(-1, whole.shape[-1])
        return grad_x, g2.t().matmul(x2), g2.sum(0), None


class _ScatterSum(torch.autograd.Function):
    """Partial sums -> this rank's slice of their sum; backward: every rank needs the whole gradient
    of its partial sum, and the ranks hold its slices: gather them."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group), None


class _SumGradients(torch.autograd.Function):
    """A replicated parameter used on this rank's tokens only: identity forward, its gradient summed
    over the group in backward (each rank's covers its own tokens)."""

    @staticmethod
    def forward(ctx, w, group):
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sequence_parallel_mlp(x, ln_weight, ln_bias, fc_weight, fc_bias, out_weight, out_bias, group=None):
    h = x.shape[-1]
    u = F.layer_norm(x, (h,), _SumGradients.apply(ln_weight, group), _SumGradients.apply(ln_bias, group))
    y = F.gelu(_GatherLinear.apply(u, fc_weight, fc_bias, group))      # (s, b, 4h/t): all tokens, my units
    z = _ScatterSum.apply(F.linear(y, out_weight), group)              # (s/t, b, h): my tokens, all units
    return x + z + _SumGradients.apply(out_bias, group)
