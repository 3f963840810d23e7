"""Wrong answer to exercise 03: everything right on the default group, but group= is ignored: the
ranks, the partition and every collective are the world's. On a subgroup of 3 of 4 ranks the
partition is cut 4 ways and the reduces and broadcasts involve a rank that is busy with its own
training (here: rank 0 alone in its group, which calls the same world collectives and mixes its
gradients in).

Caught by: test_on_a_subgroup."""
import torch
import torch.distributed as dist


def _greedy_partition(numels, world_size):
    """Index lists per rank: largest first (ties in the given order), each to the least-loaded rank
    (ties: the lowest rank). torch's ZeroRedundancyOptimizer._partition_parameters does the same."""
    order = sorted(range(len(numels)), key=lambda i: -numels[i])     # stable: ties keep their order
    loads, out = [0] * world_size, [[] for _ in range(world_size)]
    for i in order:
        r = loads.index(min(loads))
        out[r].append(i)
        loads[r] += numels[i]
    return out


class ParamZero1:
    def __init__(self, params, optimizer_class, *, group=None, **defaults):
        self.group = group
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.params = [p for p in dict.fromkeys(params) if p.requires_grad]
        parts = _greedy_partition([p.numel() for p in self.params], self.world_size)
        self.partition = [[self.params[i] for i in sorted(ids)] for ids in parts]   # model order
        self.owner = {id(p): r for r, ps in enumerate(self.partition) for p in ps}
        self.local = optimizer_class(self.partition[self.rank], **defaults)       # state: own params only

    def _global(self, r):
        return r

    @torch.no_grad()
    def step(self):
        # One flat buffer per owner: each rank's gradients of that owner's parameters, reduced (summed)
        # to the owner only. Every element is sent once: Ψ in all, like a reduce-scatter's output.
        for r, ps in enumerate(self.partition):
            if not ps:
                continue
            # An unused parameter (no gradient on any rank) travels as zeros, so that every rank
            # packs the same layout, and gets no gradient back: AdamW then skips it, as one process
            # would (a zero gradient would still move it, by weight decay and by its moments).
            flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in ps])
            dist.reduce(flat, dst=self._global(r))
            if r == self.rank:
                flat /= self.world_size                          # the sum over ranks -> the mean
                for p, g in zip(ps, flat.split([p.numel() for p in ps])):
                    p.grad = None if p.grad is None else g.view_as(p)
        self.local.step()                                        # Adam on the owned parameters only
        for r, ps in enumerate(self.partition):                  # the owner's new values to every rank
            if not ps:
                continue
            flat = torch.cat([p.detach().reshape(-1) for p in ps])
            dist.broadcast(flat, src=self._global(r))
            if r != self.rank:
                for p, v in zip(ps, flat.split([p.numel() for p in ps])):
                    p.copy_(v.view_as(p))

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def largest_share(numels, world_size):
    """The fraction of the optimizer state the most loaded rank holds under the greedy partition."""
    parts = _greedy_partition(numels, world_size)
    return max(sum(numels[i] for i in ids) for ids in parts) / sum(numels)
