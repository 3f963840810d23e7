"""Memory-centric tiling (Rajbhandari et al., ZeRO-Infinity, arXiv 2104.07857, Sec. 5.1.3): a linear
layer too large to hold whole is computed as a sequence of tiles, each fetched, used and freed
before the next, so its working memory is one tile, not the layer.

The paper's case: offloading all model states still leaves the largest single operator to be held
whole while it computes (its "model state working memory"); in an ablation of its evaluation
(single-layer models, GPU memory pre-fragmented into 2 GB chunks) a tiling factor of 16 trains
hidden sizes up to 64K where 8K was the limit without, with no tensor-slicing model parallelism.
DeepSpeed's ``deepspeed.zero.TiledLinear`` (``deepspeed/runtime/zero/tiling.py``) builds the layer
from ``in_splits x out_splits`` separate ``nn.Linear`` tiles, so that ZeRO-3 gathers, uses and
releases each tile as its own module (and offloads it, with ``offload_param``); the partial sums
over ``in_splits`` are added, the ``out_splits`` outputs concatenated.

:class:`TiledLinear` here tiles on OUTPUT features only and keeps the weight in a file on disk:
tile i is rows ``rows[i]`` of the weight; ``y[..., rows[i]] = x @ W[rows[i]].T + b[rows[i]]``. Each
output element is the same dot product as ``nn.Linear``'s, so the result is equal; whether it is
equal BIT FOR BIT depends on the matrix-multiply kernel summing that dot product in the same order
for a narrower weight (lesson 13 measures it). Splitting on input features instead would add partial
sums in another order: equal only to rounding. The weight is frozen here (forward, and backward for
the input's gradient, fetching each tile again): a trainable tiled weight needs its gradients to go
somewhere tile by tile too, which is what ZeRO-3 does for DeepSpeed's tiles.
"""
import os
import pathlib
import secrets
import time

import torch
import torch.nn as nn

from zerolab.aio import DiskFile, aligned_empty, round_up


class TiledLinear(nn.Module):
    """``linear``'s weight, split into ``tiles`` row blocks (output features), written to a file in
    ``folder``; forward fetches, uses and frees one tile at a time. ``stats``: reads, bytes read,
    seconds reading, the largest tile held (bytes). ``close()`` removes the file."""

    def __init__(self, linear, tiles, folder, *, direct="auto"):
        super().__init__()
        out_features, in_features = linear.weight.shape
        if not isinstance(tiles, int) or isinstance(tiles, bool) or not 1 <= tiles <= out_features:
            raise ValueError(f"tiles={tiles!r}: use an int from 1 to out_features={out_features}")
        self.in_features, self.out_features, self.tiles = in_features, out_features, tiles
        w = linear.weight.detach()
        self.dtype = w.dtype
        self.rows = [len(r) for r in torch.arange(out_features).tensor_split(tiles)]
        self.starts = [sum(self.rows[:i]) for i in range(tiles)]
        self.tile_bytes = [r * in_features * w.element_size() for r in self.rows]
        self.offsets = [sum(round_up(b) for b in self.tile_bytes[:i]) for i in range(tiles)]
        self.path = pathlib.Path(folder) / f"zerolab-tiled-{os.getpid()}-{secrets.token_hex(4)}.bin"
        self.file = DiskFile(self.path, direct=direct, create=True, size=self.offsets[-1] + round_up(self.tile_bytes[-1]))
        for i in range(tiles):
            buf = aligned_empty(round_up(self.tile_bytes[i]))
            buf.zero_()
            buf[:self.tile_bytes[i]].copy_(w[self.starts[i]:self.starts[i] + self.rows[i]].reshape(-1).view(torch.uint8))
            self.file.write(buf, self.offsets[i])
        self.file.sync()
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.stats = {"reads": 0, "bytes": 0, "seconds": 0.0, "largest_tile": 0}

    def fetch(self, i):
        """Tile i (rows[i] x in_features), read from the file into new memory: the caller frees it by
        dropping it."""
        buf = aligned_empty(round_up(self.tile_bytes[i]))
        t0 = time.perf_counter()
        self.file.read(buf, self.offsets[i])
        self.stats["seconds"] += time.perf_counter() - t0
        self.stats["reads"] += 1
        self.stats["bytes"] += buf.numel()
        self.stats["largest_tile"] = max(self.stats["largest_tile"], buf.numel())
        return buf[:self.tile_bytes[i]].view(self.dtype).view(self.rows[i], self.in_features)

    def forward(self, x):
        return _Tiled.apply(x, self)

    def close(self):
        self.file.close()
        self.path.unlink(missing_ok=True)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, tiles={self.tiles}, file={self.path.name}"


class _Tiled(torch.autograd.Function):
    """y = x W^T + b tile by tile; backward: dx = sum over tiles of dy[..., rows_i] W_i (each tile
    fetched again: nothing of the weight is saved for backward)."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        ctx.save_for_backward(x)
        out = x.new_empty(*x.shape[:-1], layer.out_features)
        for i in range(layer.tiles):
            w = layer.fetch(i)                              # one tile in memory
            lo, hi = layer.starts[i], layer.starts[i] + layer.rows[i]
            b = None if layer.bias is None else layer.bias[lo:hi]
            out[..., lo:hi] = torch.nn.functional.linear(x, w, b)
            del w                                           # freed before the next tile is read
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, = ctx.saved_tensors
        layer = ctx.layer
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.zeros_like(x)
            for i in range(layer.tiles):
                w = layer.fetch(i)
                lo, hi = layer.starts[i], layer.starts[i] + layer.rows[i]
                grad_x += grad_out[..., lo:hi] @ w
                del w
        return grad_x, None
