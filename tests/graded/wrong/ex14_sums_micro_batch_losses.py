"""Wrong: backpropagates each micro-batch's loss as it is: the gradient of the SUM of the m
losses, m times the mean's.

Caught by: test_1f1b_equals_one_process."""
import torch
import torch.distributed as dist

from zerolab import comm


def one_f_one_b_step(stage, m, *, inputs=None, targets=None, loss_fn=None, shape=None, dtype=None, group=None):
    s, p = dist.get_rank(group), dist.get_world_size(group)
    first, last = s == 0, s == p - 1
    held, losses, sends = {}, [], []

    def forward(k):
        if first:
            x = inputs[k]
        else:
            x = torch.empty(shape, dtype=dtype)
            comm.irecv(x, s - 1, group).wait()          # the activation of micro-batch k
            x.requires_grad_()
        out = stage(x)
        if last:
            loss = loss_fn(out, targets[k])
            losses.append(float(loss))
            out = loss
        else:
            out_ = out.detach().contiguous()
            sends.append((comm.isend(out_, s + 1, group), out_))   # asynchronous: never wait on a
        held[k] = (x, out)                              # neighbour that is sending to us

    def backward(k):
        x, out = held.pop(k)                            # the oldest micro-batch in flight
        if last:
            out.backward()
        else:
            grad = torch.empty(shape, dtype=dtype)
            comm.irecv(grad, s + 1, group).wait()
            out.backward(grad)
        if not first:
            g = x.grad.contiguous()
            sends.append((comm.isend(g, s - 1, group), g))

    warmup = min(p - s - 1, m)          # the deeper the stage, the fewer forwards before backward
    for k in range(warmup):
        forward(k)
    for k in range(m - warmup):         # steady state: one forward, one backward
        forward(warmup + k)
        backward(k)
    for k in range(m - warmup, m):      # drain
        backward(k)
    for work, _ in sends:
        work.wait()
    return losses


def _slices(x, group):
    t = dist.get_world_size(group)
    if x.shape[0] % t:
        raise ValueError(f"dim 0 ({x.shape[0]}) must be a multiple of the group size ({t})")
    return t


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        t = _slices(x, group)
        x = x.contiguous()
        out = torch.empty((x.shape[0] // t,) + tuple(x.shape[1:]), dtype=x.dtype)
        comm.reduce_scatter(out, x, group=group)        # sum over ranks, this rank's slice
        return out

    @staticmethod
    def backward(ctx, grad):
        t = dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        full = torch.empty((grad.shape[0] * t,) + tuple(grad.shape[1:]), dtype=grad.dtype)
        comm.all_gather(full, grad, group=ctx.group)    # every slice's gradient: d(sum)/dx_r
        return full, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        t = dist.get_world_size(group)
        x = x.contiguous()
        full = torch.empty((x.shape[0] * t,) + tuple(x.shape[1:]), dtype=x.dtype)
        comm.all_gather(full, x, group=group)
        return full

    @staticmethod
    def backward(ctx, grad):
        t = dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        out = torch.empty((grad.shape[0] // t,) + tuple(grad.shape[1:]), dtype=grad.dtype)
        comm.reduce_scatter(out, grad, group=ctx.group)  # partial gradients: summed, then sliced
        return out, None


def reduce_scatter_sequence(x, group=None):
    return _ReduceScatter.apply(x, group)


def all_gather_sequence(x, group=None):
    return _AllGather.apply(x, group)
