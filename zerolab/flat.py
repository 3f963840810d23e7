"""Flat, padded, sharded parameter storage: the data structure under ZeRO stages 1, 2 and 3.

All trainable parameters of one dtype are packed back to back into ONE contiguous buffer, padded
with zeros to a multiple of the world size N, so that it splits into N equal contiguous shards.
Rank r owns shard r: elements [r * S, (r + 1) * S) with S = padded / N. Each parameter becomes a
view into the buffer, so the model computes on the buffer without knowing it.

    buffer:  | p0 ....... | p1 .. | p2 ............ | pad |
    shards:  |  rank 0   |  rank 1   |  rank 2   |  rank 3  |

Why flat: one reduce-scatter / all-gather per buffer instead of one per parameter, and a shard
boundary may cut a parameter in two without any special case (the ZeRO paper's partitioning;
DeepSpeed pads its flat buffers the same way).
"""
import torch


def unique_trainable(params):
    """Trainable parameters, each once, in order (tied weights appear once)."""
    seen, out = set(), []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class FlatParams:
    """Packs ``params`` (one dtype, one device) into a padded flat buffer; params become views.

    Attributes: ``numel`` (real elements), ``padding`` (zeros added), ``shard_numel`` (S),
    ``data`` (the full buffer, or None once :meth:`release_full` dropped it, as ZeRO-3 does),
    ``offsets`` (start of each parameter in the buffer).
    """

    def __init__(self, params, world_size, rank, dtype=None):
        params = list(params)
        if not params:
            raise ValueError("FlatParams needs at least one parameter")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("FlatParams got the same parameter twice (tied weights must appear once)")
        self.params, self.world_size, self.rank = params, world_size, rank
        self.dtype = dtype or params[0].dtype
        self.device = params[0].device
        if any(p.device != self.device for p in params):
            raise ValueError("FlatParams: all parameters must be on one device")
        self.shapes = [p.shape for p in params]
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.shard_numel = -(-total // world_size)            # ceil(numel / N)
        self.padding = self.shard_numel * world_size - total  # < N zeros at the end
        self.data = torch.zeros(self.shard_numel * world_size, dtype=self.dtype, device=self.device)
        for p, off in zip(params, self.offsets):
            self.data[off:off + p.numel()].copy_(p.detach().reshape(-1))
        self.bind(self.data)

    @property
    def padded_numel(self):
        return self.shard_numel * self.world_size

    def shard_range(self, rank=None):
        r = self.rank if rank is None else rank
        return r * self.shard_numel, (r + 1) * self.shard_numel

    def shard(self, buffer):
        """This rank's slice (a view) of any buffer laid out like ``data``."""
        lo, hi = self.shard_range()
        return buffer[lo:hi]

    def views(self, buffer):
        """Views of ``buffer`` shaped like each parameter (used for params and for grads)."""
        return [buffer[off:off + p.numel()].view(shape)
                for p, off, shape in zip(self.params, self.offsets, self.shapes)]

    def shard_from(self, tensors, dtype=None):
        """This rank's shard (a new tensor, padding zero) laid out like ``data`` but filled from
        ``tensors``, one per parameter: e.g. the fp32 originals of a buffer cast to bf16, so that
        the fp32 master shard starts from the exact initial values (mixed precision)."""
        lo, hi = self.shard_range()
        out = torch.zeros(hi - lo, dtype=dtype or self.dtype, device=self.device)
        for t, off in zip(tensors, self.offsets):
            a, b = max(lo, off), min(hi, off + t.numel())   # overlap of the param with the shard
            if a < b:
                out[a - lo:b - lo].copy_(t.detach().reshape(-1)[a - off:b - off])
        return out

    def shard_padding(self, rank=None):
        """How many of the padding zeros lie in ``rank``'s shard (the last shards hold them)."""
        lo, hi = self.shard_range(rank)
        return max(0, hi - max(lo, self.numel))

    def view(self, buffer, i):
        """View of ``buffer`` shaped like parameter i (one view: cheap enough for a per-param hook)."""
        off = self.offsets[i]
        return buffer[off:off + self.shapes[i].numel()].view(self.shapes[i])

    def bind(self, buffer):
        """Make every parameter a view into ``buffer`` (same layout as ``data``)."""
        for p, v in zip(self.params, self.views(buffer)):
            p.data = v

    def new_buffer(self, dtype=None):
        return torch.zeros(self.padded_numel, dtype=dtype or self.dtype, device=self.device)

    def release_full(self, keep_shard=True):
        """Drop the full buffer, keeping only a copy of this rank's shard (ZeRO-3's resting state).
        Parameters point at empty tensors until the next :meth:`bind`."""
        own = self.shard(self.data).clone() if keep_shard else None
        self.data = None
        for p in self.params:
            p.data = torch.empty(0, dtype=self.dtype, device=self.device)
        return own
