"""Tensor parallelism (Megatron-LM) and sequence parallelism: each layer's matrices split over t ranks.

Data parallelism, and every ZeRO stage, runs the whole model on every rank. Tensor parallelism
(Shoeybi et al., *Megatron-LM*, arXiv 1909.08053, Sec. 3) splits each transformer layer itself over
the t ranks of a group: the MLP's first weight A by columns and its second B by rows, attention by
heads, so that each rank computes 1/t of every matrix multiply and holds 1/t of its weights:

    MLP:        Y = GeLU(X A),  Z = Y B      A = [A_1 .. A_t] (columns), B = [B_1; ..; B_t] (rows)
    rank i:     Y_i = GeLU(X A_i)            no communication: GeLU is elementwise per column
                Z = sum_i Y_i B_i            one all-reduce of the (s, b, h) output
    attention:  heads a/t per rank (Q, K, V are column-parallel), the output projection row-parallel

Two conjugate operators carry every byte (the paper's Fig. 3; Megatron-LM's
megatron/core/tensor_parallel/mappings.py):

=====================================  ======================  ======================
operator                               forward                 backward
=====================================  ======================  ======================
f: :class:`CopyToTensorParallel`       identity                all-reduce
g: :class:`ReduceFromTensorParallel`   all-reduce              identity
=====================================  ======================  ======================

(Korthikanti et al. call them f and f-bar.) f enters each column-parallel linear, g leaves each
row-parallel one: per layer (attention + MLP) two all-reduces of the (s, b, h) activation in forward
and two in backward, 2(t-1)/t of its bytes sent per rank each (a ring). Megatron-Core today fuses f
into the column-parallel linear's backward, where the all-reduce of the input gradient runs
asynchronously beside the weight-gradient GEMM (layers.py,
``LinearWithGradAccumulationAndAsyncCommunication``); the bytes are the same.

**Sequence parallelism** (Korthikanti et al., arXiv 2205.05198, Sec. 4.2.2). What tensor
parallelism leaves whole on every rank — LayerNorms, dropouts, the residual stream — acts on each
token independently, so it is split along the sequence: each rank keeps s/t of the tokens there.
The all-reduces become reduce-scatter + all-gather, the same bytes under a ring, since a ring
all-reduce IS a reduce-scatter followed by an all-gather:

=======================================================  ======================  ======================
operator (Megatron-LM: mappings.py)                      forward                 backward
=======================================================  ======================  ======================
:class:`GatherFromSequenceParallel` (the paper's g)      all-gather along s      reduce-scatter along s
:class:`ReduceScatterToSequenceParallel` (g-bar)         reduce-scatter along s  all-gather along s
=======================================================  ======================  ======================

A column-parallel linear needs the whole sequence of its input for its weight gradient. Megatron-LM
keeps only this rank's s/t slice and all-gathers it again in backward (layers.py, the
``sequence_parallel`` branch of ``LinearWithGradAccumulationAndAsyncCommunication``): one more
all-gather per column-parallel linear in backward, and every per-token activation of the layer is
then 1/t per rank, the paper's s·b·h·(34 + 5as/h)/t. The re-gather sends 2(t-1)/t·sbh values per
layer on top of g/g-bar's 8(t-1)/t·sbh (10 in all; Megatron-LM launches it asynchronously and runs
the input-gradient GEMM beside it: layers.py lines 674-687 at commit d98e8a6). ``regather=False``
keeps the gathered input instead (the g/g-bar bytes alone, 2·e·s·b·h·(1 - 1/t) more activation
memory per layer).

Layout: (s, b, h), sequence first, as Megatron-LM, so that a slice of the sequence is contiguous.
LayerNorm weights and the row-parallel biases are replicated; with sequence parallelism each rank's
gradient of them covers only its tokens, so they enter through f and are summed over the group
inside backward (:class:`SequenceParallelLayerNorm`; six all-reduces of h values per layer;
Megatron-LM sums them once per step, coalesced, in finalize_model_grads.py).
:class:`TensorParallelGPT` splits a :class:`zerolab.models.TinyGPT`; its embeddings, final LayerNorm
and (tied) output layer stay replicated (Megatron-LM also splits the vocabulary:
``VocabParallelEmbedding`` and a vocabulary-parallel cross-entropy; not here).

Reduce-scatters run as lesson 00's ring on gloo (torch emulates gloo's with a full all-reduce:
twice the bytes), torch's on NCCL, as the ZeRO engines do.
"""
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from zerolab import comm
from zerolab.models import CoreAttention
from zerolab.ring import ring_reduce_scatter


# -- collectives along dim 0 (the sequence, in the (s, b, h) layout) -----------------------------
def _reduce_scatter(x, group, tag):
    """Sum over the group of x (s, b, h); returns this rank's (s/t, b, h) slice of the sum."""
    t = dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty((x.shape[0] // t,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    if dist.get_backend(group) == "gloo":
        ring_reduce_scatter(out, x, group, tag=tag)    # (t-1)/t of x's bytes sent
    else:
        comm.reduce_scatter(out, x, group=group, tag=tag)
    return out


def _all_gather(x, group, tag):
    """Every rank's (s/t, b, h) slice, concatenated in rank order: (s, b, h)."""
    t = dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty((x.shape[0] * t,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out, x, group=group, tag=tag)       # (t-1)/t of out's bytes sent
    return out


def _split(x, group):
    """This rank's slice along dim 0, in storage of its own (a view would keep the whole alive)."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(t, dim=0)[r].clone()


# -- Megatron-LM's f and g (Shoeybi et al. 2019, Fig. 3) -------------------------------------------
class CopyToTensorParallel(torch.autograd.Function):
    """f: identity in forward (every rank already holds the whole input X), all-reduce in backward
    (each rank's column slice A_i gives only part of dL/dX; the sum over ranks is the whole)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group=ctx.group, tag="f backward")      # 2(t-1)/t x (s, b, h) bytes
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: all-reduce in forward (each rank's row slice B_i gives a partial sum Y_i B_i of the
    output), identity in backward (dL/dZ is the same on every rank)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        comm.all_reduce(out, group=group, tag="g forward")            # 2(t-1)/t x (s, b, h) bytes
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# -- sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2) -------------------------------------
class ScatterToSequenceParallel(torch.autograd.Function):
    """Enter the sequence-parallel region from a replicated tensor: keep this rank's s/t slice (no
    communication); backward all-gathers the slices' gradients into the whole one."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, "scatter backward"), None


class GatherFromSequenceParallel(torch.autograd.Function):
    """The paper's g: all-gather the sequence slices in forward. Backward: reduce-scatter when what
    follows is tensor-parallel (each rank's gradient is a partial sum over its columns), or just this
    rank's slice when what follows is replicated (``tensor_parallel_output_grad=False``: every rank
    computed the same thing, and summing would count it t times). Megatron-LM: mappings.py,
    ``_GatherFromSequenceParallelRegion``."""

    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad=True):
        ctx.group, ctx.reduce = group, tensor_parallel_output_grad
        return _all_gather(x, group, "g forward")

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce:
            return _reduce_scatter(grad, ctx.group, "g backward"), None, None
        return _split(grad, ctx.group), None, None


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """The paper's g-bar: the row-parallel layer's partial sums, reduce-scattered along the sequence
    in forward; all-gather of the gradient slices in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group, "g-bar forward")

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, "g-bar backward"), None


class _SequenceParallelLinear(torch.autograd.Function):
    """Column-parallel linear on a sequence slice, Megatron-LM's way: all-gather the input, multiply,
    and save only the slice; in backward gather it again for the weight gradient, and reduce-scatter
    the input gradient (layers.py, ``LinearWithGradAccumulationAndAsyncCommunication``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)                                # the s/t slice, not the whole
        return F.linear(_all_gather(x, group, "g forward"), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        full = _all_gather(x, ctx.group, "re-gather backward")        # the extra all-gather
        grad_input = _reduce_scatter(grad.matmul(weight), ctx.group, "g backward")
        g2, x2 = grad.reshape(-1, grad.shape[-1]), full.reshape(-1, full.shape[-1])
        grad_weight = g2.t().matmul(x2)
        grad_bias = g2.sum(dim=0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None


# -- the layers ------------------------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i + b_i: this rank's ``rows`` of the full weight (out_features/t outputs). Input:
    the whole X, replicated (through f), or with ``sequence_parallel`` this rank's sequence slice
    (gathered inside). Output: this rank's columns of Y, for the whole sequence."""

    def __init__(self, linear, rows, group, *, sequence_parallel=False, regather=True):
        super().__init__()
        self.group, self.sequence_parallel, self.regather = group, sequence_parallel, regather
        self.rows = torch.as_tensor(rows)
        self.weight = nn.Parameter(linear.weight.detach()[self.rows].clone())        # (out/t, in)
        self.bias = nn.Parameter(linear.bias.detach()[self.rows].clone()) if linear.bias is not None else None

    def forward(self, x):
        if self.sequence_parallel:
            return self._forward_sequence_parallel(x)                 # lesson 14, section 2
        return F.linear(CopyToTensorParallel.apply(x, self.group), self.weight, self.bias)

    def _forward_sequence_parallel(self, x):
        if self.regather:
            return _SequenceParallelLinear.apply(x, self.weight, self.bias, self.group)
        return F.linear(GatherFromSequenceParallel.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Z = sum_i Y_i B_i + b: this rank's ``cols`` of the full weight (in_features/t inputs); the
    partial products are all-reduced (g), or reduce-scattered along the sequence with
    ``sequence_parallel`` (g-bar); the bias, replicated, is added once, after the sum."""

    def __init__(self, linear, cols, group, *, sequence_parallel=False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.cols = torch.as_tensor(cols)
        self.weight = nn.Parameter(linear.weight.detach()[:, self.cols].clone())     # (out, in/t)
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None

    def forward(self, x):
        partial = F.linear(x, self.weight)                                       # Y_i B_i
        if self.sequence_parallel:
            return self._forward_sequence_parallel(partial)            # lesson 14, section 2
        z = ReduceFromTensorParallel.apply(partial, self.group)
        return z + self.bias if self.bias is not None else z

    def _forward_sequence_parallel(self, partial):
        z = ReduceScatterToSequenceParallel.apply(partial, self.group)
        # the bias meets only this rank's tokens: its gradient is summed over the group (f)
        return z + CopyToTensorParallel.apply(self.bias, self.group) if self.bias is not None else z


class TensorParallelAttention(nn.Module):
    """Self-attention split by heads: this rank's a/t heads' rows of Q, K and V (column-parallel),
    attention computed on them alone, and the output projection's matching columns (row-parallel)."""

    def __init__(self, block, group, *, sequence_parallel=False, regather=True):
        super().__init__()
        t, r = dist.get_world_size(group), dist.get_rank(group)
        c, heads = block.qkv.in_features, block.n_heads
        self.local_heads, self.head_dim = heads // t, c // heads
        mine = torch.arange(r * c // t, (r + 1) * c // t)              # this rank's heads' channels
        self.qkv = ColumnParallelLinear(block.qkv, torch.cat([mine, c + mine, 2 * c + mine]), group,
                                        sequence_parallel=sequence_parallel, regather=regather)
        self.core_attention = CoreAttention(block.core_attention.kind)
        self.proj = RowParallelLinear(block.proj, mine, group, sequence_parallel=sequence_parallel)

    def forward(self, x):                                               # (s, b, h) or (s/t, b, h)
        qkv = self.qkv(x)                                               # (s, b, 3h/t)
        s, b, _ = qkv.shape
        q, k, v = (u.view(s, b, self.local_heads, self.head_dim).permute(1, 2, 0, 3)
                   for u in qkv.split(self.local_heads * self.head_dim, dim=2))   # (b, a/t, s, d)
        y = self.core_attention(q, k, v)                                # (b, a/t, s, d)
        return self.proj(y.permute(2, 0, 1, 3).reshape(s, b, -1))       # (s, b, h/t) -> g or g-bar


class TensorParallelBlock(nn.Module):
    """A TinyGPT block split over ``group``: x + attention(ln1(x)), then x + MLP(ln2(x)), with the
    MLP column- then row-parallel. ``sequence_parallel``: x, the LayerNorms and the residual adds
    hold s/t of the tokens."""

    def __init__(self, block, group, *, sequence_parallel=False, regather=True):
        super().__init__()
        t, r = dist.get_world_size(group), dist.get_rank(group)
        norm = (lambda ln: SequenceParallelLayerNorm(ln, group)) if sequence_parallel else copy.deepcopy
        self.ln1, self.ln2 = norm(block.ln1), norm(block.ln2)
        self.attn = TensorParallelAttention(block, group, sequence_parallel=sequence_parallel, regather=regather)
        hidden = block.fc.out_features
        mine = torch.arange(r * hidden // t, (r + 1) * hidden // t)
        self.fc = ColumnParallelLinear(block.fc, mine, group, sequence_parallel=sequence_parallel, regather=regather)
        self.out = RowParallelLinear(block.out, mine, group, sequence_parallel=sequence_parallel)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class SequenceParallelLayerNorm(nn.LayerNorm):
    """A replicated LayerNorm on this rank's tokens: the gradient of its weight and bias on each rank
    covers only those tokens, so they enter through f and autograd sums them over the group, inside
    backward (any ZeRO stage's gradient hooks then see the whole gradient). Megatron-LM instead marks
    them ``sequence_parallel`` and all-reduces them once per step, coalesced, after the data-parallel
    reduction (``_allreduce_non_tensor_model_parallel_grads`` in finalize_model_grads.py): the same
    sum, fewer and larger calls."""

    def __init__(self, ln, group):
        super().__init__(ln.normalized_shape, eps=ln.eps, dtype=ln.weight.dtype)
        self.group = group
        with torch.no_grad():
            self.weight.copy_(ln.weight)
            self.bias.copy_(ln.bias)

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, CopyToTensorParallel.apply(self.weight, self.group),
                            CopyToTensorParallel.apply(self.bias, self.group), self.eps)


def check_split(t, *, heads, hidden, seq_len=None):
    """ValueError unless ``t`` ranks can split a TinyGPT: its heads, its MLP's width and, for sequence
    parallelism (``seq_len`` given), its sequence length must be multiples of t."""
    if heads % t or hidden % t:
        raise ValueError(f"tensor parallelism over {t} ranks needs n_heads ({heads}) and the MLP width "
                         f"({hidden}) divisible by {t}: choose a group size that divides both")
    if seq_len is not None and seq_len % t:
        raise ValueError(f"sequence parallelism over {t} ranks needs the sequence length ({seq_len}) "
                         f"divisible by {t}: choose a sequence length that {t} divides")


class TensorParallelGPT(nn.Module):
    """:class:`zerolab.models.TinyGPT` split over the ranks of ``group`` (every rank passes the same
    full model, built from the same seed, and keeps its shards): blocks tensor-parallel (sequence-
    parallel too with ``sequence_parallel=True``), embeddings, final LayerNorm and output layer
    replicated. ``model(idx, targets)`` -> the loss, the same on every rank of the group.

    ``shards``: {name of a parameter here: (name in the full model, dim, index)}, where index (a
    LongTensor along dim) says which part of the full parameter it is, or None for a whole replica:
    what a test needs to compare each rank's gradient with one process's."""

    def __init__(self, model, group, *, sequence_parallel=False, regather=True):
        super().__init__()
        self.t = dist.get_world_size(group)
        check_split(self.t, heads=model.blocks[0].n_heads, hidden=model.blocks[0].fc.out_features)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.seq_len = model.seq_len
        self.tok, self.pos, self.ln_f, self.head = model.tok, model.pos, model.ln_f, model.head   # replicated
        self.blocks = nn.ModuleList(TensorParallelBlock(b, group, sequence_parallel=sequence_parallel,
                                                        regather=regather) for b in model.blocks)
        self.shards = {}
        for name, _ in self.named_parameters(remove_duplicate=False):
            owner = self.get_submodule(name.rsplit(".", 1)[0])
            full = name.replace(".attn.", ".")                  # TinyGPT names: blocks.0.qkv.weight
            if isinstance(owner, ColumnParallelLinear):
                self.shards[name] = (full, 0, owner.rows)         # rows of weight and bias
            elif isinstance(owner, RowParallelLinear) and name.endswith("weight"):
                self.shards[name] = (full, 1, owner.cols)         # columns of the weight
            else:
                self.shards[name] = (full, 0, None)               # a replica (row bias, LayerNorms, ...)

    def forward(self, idx, targets=None):                                 # idx: (b, s) token ids
        s = idx.shape[1]
        if self.sequence_parallel and s % self.t:
            check_split(self.t, heads=0, hidden=0, seq_len=s)
        x = (self.tok(idx) + self.pos(torch.arange(s, device=idx.device))).transpose(0, 1)   # (s, b, h)
        if self.sequence_parallel:
            x = ScatterToSequenceParallel.apply(x, self.group)              # (s/t, b, h)
        for block in self.blocks:
            x = block(x)
        if self.sequence_parallel:          # what follows is replicated: backward keeps the slice
            x = GatherFromSequenceParallel.apply(x, self.group, False)
        logits = self.head(self.ln_f(x.transpose(0, 1)))                    # (b, s, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
