"""Exercise 08 — the measurements that refute three myths (worked answers). See exercises/ex08_myths.py."""
import torch
import torch.distributed as dist

from zerolab import comm


def count_copies(per_rank):
    held = sum(nbytes for prints in per_rank for nbytes, _ in prints)
    # one entry per distinct content: identical replicas (data parallelism) collapse into one
    distinct = {digest: nbytes for prints in per_rank for nbytes, digest in prints}
    return held / sum(distinct.values())


def master_average(tensor, group=None):
    # the myth's parameter server: rank 0 receives N-1 tensors and sends N-1 back, (N-1)·S bytes
    # out of its one link, while every other rank sends S. (A ring all_reduce: 2(N-1)/N·S each.)
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if rank == 0:
        incoming = torch.empty_like(tensor)
        for src in range(1, n):
            comm.recv(incoming, src, group=group)
            tensor += incoming
        tensor /= n
        for dst in range(1, n):
            comm.send(tensor, dst, group=group)
    else:
        comm.send(tensor, 0, group=group)
        comm.recv(tensor, 0, group=group)


def bytes_per_rank(average, tensor, group=None):
    with comm.log(group) as log:
        average(tensor, group)
    # collected after the log is closed, so the all_gather's own bytes are not counted
    mine = torch.tensor([log.sent_bytes], dtype=torch.float64)
    every = torch.empty(dist.get_world_size(group), dtype=torch.float64)
    comm.all_gather(every, mine, group=group)
    return every.tolist()


def forward_flops(model, run):
    total = 0

    def count(module, inputs, output):
        # read at the moment of the call: under ZeRO-3 this is when the weight is whole
        nonlocal total
        rows = inputs[0].numel() // module.in_features
        total += 2 * rows * module.weight.shape[0] * module.weight.shape[1]

    handles = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return total
