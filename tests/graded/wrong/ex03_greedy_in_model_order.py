"""Wrong answer to exercise 03: greedy (each parameter to the least-loaded rank) but in the model's
order instead of largest first. Right training and traffic; the balance is worse than torch's, and
the partition is not the one the exercise asks for."""
import torch
import torch.distributed as dist


class ParamZero1:
    def __init__(self, params, optimizer_class, *, group=None, **defaults):
        self.group = group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.params = [p for p in dict.fromkeys(params) if p.requires_grad]
        self.partition = [[] for _ in range(self.world_size)]
        load = [0] * self.world_size
        for p in self.params:
            r = min(range(self.world_size), key=lambda q: load[q])
            self.partition[r].append(p)
            load[r] += p.numel()
        self.local = optimizer_class(self.partition[self.rank], **defaults)

    @torch.no_grad()
    def step(self):
        for owner, ps in enumerate(self.partition):
            if ps:
                buf = torch.cat([p.grad.flatten() for p in ps])
                dist.reduce(buf, dst=owner, group=self.group)
                if owner == self.rank:
                    for p, g in zip(ps, buf.div_(self.world_size).split([p.numel() for p in ps])):
                        p.grad.copy_(g.view_as(p))
        self.local.step()
        for owner, ps in enumerate(self.partition):
            if ps:
                buf = torch.cat([p.flatten() for p in ps])
                dist.broadcast(buf, src=owner, group=self.group)
                for p, v in zip(ps, buf.split([p.numel() for p in ps])):
                    p.copy_(v.view_as(p))

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def largest_share(numels, world_size):
    load = [0] * world_size
    for n in sorted(numels, reverse=True):
        load[load.index(min(load))] += n
    return max(load) / sum(numels)
