"""Wrong: one scale for the whole tensor (repeated per block so the shapes look right)."""
import torch
import torch.distributed as dist

from zerolab import comm


def quantize_blocks(x, block):
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    scale = flat.abs().max() / 127
    safe = scale if scale > 0 else torch.tensor(1.0)
    codes = torch.round(flat / safe).clamp(-127, 127).to(torch.int8)
    return codes, scale.repeat(-(-n // block)).float()


def dequantize_blocks(codes, scales, block):
    n = codes.numel()
    padded = torch.zeros(scales.numel() * block, dtype=torch.float32)
    padded[:n] = codes.float()
    return (padded.view(-1, block) * scales[:, None]).view(-1)[:n]


def hsdp_reduce_gradients(grad, intra, inter):
    p, m = dist.get_world_size(intra), dist.get_world_size(inter)
    shard = torch.empty(grad.numel() // p, dtype=grad.dtype)
    comm.reduce_scatter(shard, grad.reshape(-1), group=intra)
    comm.all_reduce(shard, group=inter)
    return shard.div_(m * p)
