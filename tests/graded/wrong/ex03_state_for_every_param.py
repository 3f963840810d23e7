"""Wrong answer to exercise 03: one optimizer over every trainable parameter on every rank; after the
reduce, the parameters this rank does not own get a zero gradient so that the optimizer "steps them
harmlessly", and the owners' broadcasts overwrite them anyway. Values and traffic are right; but
every rank now holds Adam's moments for the whole model: the memory ZeRO-1 exists to save.

Caught by: test_partition_and_state_like_torch."""
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
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.params = [p for p in dict.fromkeys(params) if p.requires_grad]
        parts = _greedy_partition([p.numel() for p in self.params], self.world_size)
        self.partition = [[self.params[i] for i in sorted(ids)] for ids in parts]   # model order
        self.owner = {id(p): r for r, ps in enumerate(self.partition) for p in ps}
        self.local = optimizer_class(self.params, **defaults)

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
            else:
                for p in ps:
                    if p.grad is not None:
                        p.grad.zero_()                           # overwritten by the broadcast
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
    """The fraction of the optimizer state the most loaded rank holds under the greedy partition."""
    parts = _greedy_partition(numels, world_size)
    return max(sum(numels[i] for i in ids) for ids in parts) / sum(numels)
