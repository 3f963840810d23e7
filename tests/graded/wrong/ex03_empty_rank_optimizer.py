"""Wrong answer to exercise 03: every rank builds its optimizer over its own parameters, even when it
owns none. Right as long as every rank owns something; but with more ranks than parameters
(or one parameter outweighing the rest) a rank owns nothing and torch's optimizers refuse an empty
parameter list: the constructor raises on that rank.

Caught by: test_balance_within_four_thirds_of_the_best."""
import heapq

import torch
import torch.distributed as dist


def _partition(numels, world_size):
    """Index lists per rank, a pure function of the sizes and their order (so every rank computes the
    same one without communicating): largest first, each to the rank that owns the fewest elements so
    far (ties: by size, then position; by load, then rank). Why within 4/3 of the best (Graham): take
    the parameter p that the most loaded rank got last. If p > OPT/3, the best partition holds at most
    two parameters of size >= p per rank, and largest-first is then optimal. Otherwise, that rank was
    the least loaded when it got p, so it held at most (Ψ - p)/N <= OPT - p/N, and ends at most
    OPT + p(1 - 1/N) <= (4/3 - 1/(3N)) OPT."""
    loads = [(0, r) for r in range(world_size)]               # a heap: (elements owned, rank)
    out = [[] for _ in range(world_size)]
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        load, r = heapq.heappop(loads)
        out[r].append(i)
        heapq.heappush(loads, (load + numels[i], r))
    return out


class ParamZero1:
    def __init__(self, params, optimizer_class, *, group=None, **defaults):
        self.group = group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.params = [p for p in dict.fromkeys(params) if p.requires_grad]   # tied once, frozen never
        parts = _partition([p.numel() for p in self.params], self.world_size)
        self.partition = [[self.params[i] for i in sorted(ids)] for ids in parts]   # model order
        own = self.partition[self.rank]
        # State for the owned parameters only. A rank may own nothing (more ranks than parameters):
        # torch's optimizers refuse an empty list, and there is nothing to update.
        self.local = optimizer_class(own, **defaults)

    def _global(self, r):
        return r if self.group is None else dist.get_global_rank(self.group, r)

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
            dist.reduce(flat, dst=self._global(r), group=self.group)
            if r == self.rank:
                flat /= self.world_size                          # the sum over ranks -> the mean
                for p, g in zip(ps, flat.split([p.numel() for p in ps])):
                    p.grad = None if p.grad is None else g.view_as(p)
        self.local.step()                                        # Adam on the owned parameters only
        for r, ps in enumerate(self.partition):                  # the owner's new values to every rank
            if not ps:
                continue
            flat = torch.cat([p.detach().reshape(-1) for p in ps])
            dist.broadcast(flat, src=self._global(r), group=self.group)
            if r != self.rank:
                for p, v in zip(ps, flat.split([p.numel() for p in ps])):
                    p.copy_(v.view_as(p))

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def largest_share(numels, world_size):
    """The fraction of the optimizer state the most loaded rank holds under ParamZero1's partition."""
    parts = _partition(numels, world_size)
    return max(sum(numels[i] for i in ids) for ids in parts) / sum(numels)
