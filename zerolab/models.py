"""The small models every lesson trains: a GPT-style transformer and a toy MLP with the awkward cases.

Both are built deterministically from a seed, so every rank (and a single-process reference)
builds bit-identical weights without any communication.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


ATTENTIONS = ("sdpa", "naive")


class CoreAttention(nn.Module):
    """Causal softmax(q k^T / sqrt(d)) v over (B, H, T, d) heads; no parameters. Megatron-LM calls
    this part of the layer "core attention" (``CoreAttention``), and it is what Korthikanti et al.'s
    selective recomputation recomputes (arXiv 2205.05198, Sec. 5).

    ``kind='sdpa'``: ``F.scaled_dot_product_attention``, which picks a fused (flash / memory-efficient)
    kernel that never stores the (B, H, T, T) scores: it saves q, k, v, its output and a logsumexp per
    row, and recomputes the scores in backward. ``kind='naive'``: the textbook formula, whose softmax
    saves its (B, H, T, T) output for backward, the term quadratic in T (lesson 10)."""

    def __init__(self, kind="sdpa"):
        super().__init__()
        if kind not in ATTENTIONS:
            raise ValueError(f"attention={kind!r} is not supported: choose one of {ATTENTIONS}")
        self.kind = kind

    def forward(self, q, k, v):                             # each (B, H, T, d)
        if self.kind == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        T = q.shape[-2]
        # An additive mask (0 on and below the diagonal, -inf above): adding saves nothing for
        # backward, where masked_fill would save a (T, T) boolean mask.
        mask = torch.full((T, T), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
        scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.shape[-1])) + mask   # (B, H, T, T)
        return torch.softmax(scores, dim=-1) @ v           # softmax saves its (B, H, T, T) output


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)). ``attention``: 'sdpa'
    (fused kernel, the default) or 'naive' (stores the attention probabilities), see CoreAttention."""

    def __init__(self, d_model, n_heads, attention="sdpa"):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.core_attention = CoreAttention(attention)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x):                                   # x: (B, T, C)
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)     # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = self.core_attention(q, k, v)                    # (B, H, T, C/H)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT-2-shaped language model, small enough for a laptop CPU.

    The output layer shares its weight with the token embedding (tied weights), as GPT-2 does:
    one tensor, two uses; every ZeRO stage must count it once and give it both gradients.
    ``blocks`` is the list a ZeRO-3 engine wraps unit by unit. ``attention``: 'sdpa' or 'naive'
    (:class:`CoreAttention`); the parameters are the same either way.
    """

    def __init__(self, vocab_size=256, d_model=64, n_layers=2, n_heads=4, seq_len=32, tied=True,
                 attention="sdpa"):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, attention) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        if tied:
            self.head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * n_layers) if name.endswith("out.weight") else 1))

    def init_module(self, module):
        """TinyGPT's initialization of ONE module's own parameters, for a model built on the meta
        device (``zerolab.initialize(model, stage=3, init_fn=model.init_module)``, see
        :mod:`zerolab.meta_init`): torch's default (``reset_parameters()``), then N(0, 0.02) for every
        matrix, 0.02/sqrt(2 n_layers) for each block's output projection (GPT-2's scaled init). The
        distributions of ``__init__``, drawn in another order: other values for the same seed."""
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
        outs = {id(b.out) for b in self.blocks}
        for p in module.parameters(recurse=False):
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * len(self.blocks)) if id(module) in outs else 1))

    def forward(self, idx, targets=None):                   # idx: (B, T) token ids
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))                    # (B, T, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


class ToyMLP(nn.Module):
    """A small MLP with every awkward case: parameter sizes that no world size divides, a frozen
    layer, a weight used twice in one forward, and an integer buffer."""

    def __init__(self, d_in=13, d_hidden=37, d_out=5):
        super().__init__()
        self.inp = nn.Linear(d_in, d_hidden)
        self.frozen = nn.Linear(d_hidden, d_hidden)
        self.frozen.requires_grad_(False)
        self.mid = nn.Linear(d_hidden, d_hidden)
        self.out = nn.Linear(d_hidden, d_out)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x, targets=None):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.frozen(h))
        h = torch.tanh(self.mid(h))
        h = torch.tanh(self.mid(h))        # the same module twice: two gradient contributions
        y = self.out(h)
        if targets is None:
            return y
        return F.mse_loss(y, targets)


def build(name="gpt", seed=0, dtype=torch.float32, **kwargs):
    """Build a model with weights fixed by ``seed`` (identical on every rank, no broadcast needed)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = {"gpt": TinyGPT, "mlp": ToyMLP}[name](**kwargs)
    return model.to(dtype)


def batch(name="gpt", seed=0, batch_size=8, model=None, dtype=torch.float32, **kwargs):
    """A deterministic (inputs, targets) batch for ``build(name)``; ``seed`` picks the batch.
    For 'gpt': next-token targets of random token ids; for 'mlp': a random regression batch."""
    g = torch.Generator().manual_seed(seed)
    if name == "gpt":
        vocab = kwargs.get("vocab_size", model.tok.num_embeddings if model is not None else 256)
        seq = kwargs.get("seq_len", model.seq_len if model is not None else 32)
        tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    d_in = kwargs.get("d_in", 13)
    d_out = kwargs.get("d_out", 5)
    return (torch.randn(batch_size, d_in, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(batch_size, d_out, generator=g, dtype=torch.float64).to(dtype))
