"""Wrong: averages inside the node only; never talks across nodes (each node keeps its own mean)."""
import torch
import torch.distributed as dist

from zerolab import comm


def quantize_blocks(x, block):
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    blocks = -(-n // block)                                       # ceil: the last block may be short
    padded = torch.zeros(blocks * block, dtype=torch.float32)
    padded[:n] = flat                                             # zero padding changes no block's max
    rows = padded.view(blocks, block)                             # (blocks, block)
    scales = rows.abs().amax(dim=1) / 127                         # one fp32 scale per block
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))   # a block of zeros: codes 0
    codes = torch.round(rows / safe[:, None]).clamp(-127, 127).to(torch.int8)
    return codes.view(-1)[:n], scales


def dequantize_blocks(codes, scales, block):
    n = codes.numel()
    padded = torch.zeros(scales.numel() * block, dtype=torch.float32)
    padded[:n] = codes.float()
    return (padded.view(-1, block) * scales[:, None]).view(-1)[:n]


def hsdp_reduce_gradients(grad, intra, inter):
    p = dist.get_world_size(intra)
    shard = torch.empty(grad.numel() // p, dtype=grad.dtype)
    comm.reduce_scatter(shard, grad.reshape(-1), group=intra)
    return shard.div_(p)
