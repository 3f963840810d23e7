"""Wrong answer to exercise 08: to spare the servers' links, the ranks that are not servers add
their tensors up along a chain (rank N-1 to N-2, ..., down to rank K), and only rank K sends the
chain's sum to the servers, part by part. Right averages, point to point, even parts, and fewer
bytes into the servers; but ranks that are not servers now talk to each other, and the scheme is no
longer the sharded server whose traffic the lesson measures.

Caught by: test_sharded_server_traffic."""
import torch
import torch.distributed as dist

from zerolab import comm, models


def sharded_server_average(tensor, servers, group=None):
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if isinstance(servers, bool) or not isinstance(servers, int) or not 1 <= servers <= n:
        raise ValueError(f"servers={servers!r} must be between 1 and the group's size {n}")
    flat = tensor.view(-1)
    parts = flat.tensor_split(servers)
    k = servers
    if rank >= k:                                          # the chain: n-1 -> n-2 -> ... -> k
        acc = flat.clone()
        if rank + 1 < n:
            inc = torch.empty_like(flat)
            comm.recv(inc, rank + 1, group=group)
            acc += inc
        if rank > k:
            comm.send(acc, rank - 1, group=group)
        else:                                              # rank k: the chain's sum, part by part
            works = [comm.isend(a.contiguous(), j, group=group) for j, a in enumerate(acc.tensor_split(k))]
            for w in works:
                w.wait()
    else:                                                  # a server: its part from the other servers
        works = [comm.isend(parts[j].contiguous(), j, group=group) for j in range(k) if j != rank]
        inbox = [torch.empty_like(parts[rank]) for _ in range(k + (1 if k < n else 0))]
        works += [comm.irecv(inbox[j], j, group=group) for j in range(k) if j != rank]
        if k < n:
            works.append(comm.irecv(inbox[k], k, group=group))
        for w in works:
            w.wait()
        for j in range(len(inbox)):
            if j != rank:
                parts[rank].add_(inbox[j])
        parts[rank].div_(n)
    works = [comm.isend(parts[rank].contiguous(), r, group=group) for r in range(n) if rank < k and r != rank]
    works += [comm.irecv(parts[j], j, group=group) for j in range(k) if j != rank]
    for w in works:
        w.wait()
    return tensor


def bytes_per_element(param_dtype):
    import zerolab
    n, rank = dist.get_world_size(), dist.get_rank()
    model = models.build("gpt")
    engine = zerolab.initialize(model, stage=2, lr=1e-3, param_dtype=param_dtype)
    x, y = models.batch("gpt", seed=rank, model=model)
    for measured in (False, True):                        # the first step warms up (lazy state, sockets)
        dist.barrier()
        with comm.log() as log:
            engine.backward(engine(x, y))
            engine.step()
        engine.zero_grad()
    psi = sum(p.numel() for p in dict.fromkeys(model.parameters()) if p.requires_grad)
    return log.measured_bytes / (2 * (n - 1) / n * psi)   # reduce-scatter + all-gather, ring: 2(N-1)/N Ψ
