"""Every engine, by (stage, offload), and :func:`initialize`, which picks one from that table.

    engine = zerolab.initialize(model, stage=2, optimizer=torch.optim.AdamW, lr=1e-3,
                                param_dtype=torch.bfloat16)

=====  ========================  =====================================================================
stage  module                    what each rank keeps (Ψ parameters, N ranks, K bytes/param of optimizer)
=====  ========================  =====================================================================
0      :mod:`zerolab.zero0`      everything: (2 + 2 + K)Ψ, the data-parallel baseline
1      :mod:`zerolab.zero1`      optimizer states 1/N: 4Ψ + KΨ/N
2      :mod:`zerolab.zero2`      + gradients 1/N: 2Ψ + (2 + K)Ψ/N
3      :mod:`zerolab.zero3`      + parameters 1/N: (4 + K)Ψ/N, gathered layer by layer
+off   :mod:`zerolab.offload`    stages 1-3 with master, moments and gradient shard on the host
+disk  :mod:`zerolab.infinity`   stages 1-3 with master and moments in a file on disk, streamed
=====  ========================  =====================================================================
"""
import torch

from zerolab.engine import check_common, check_same_model, split_options
from zerolab.hybrid import HybridEngine
from zerolab.infinity import Zero1DiskEngine, Zero2DiskEngine, Zero3DiskEngine
from zerolab.offload import Zero1OffloadEngine, Zero2OffloadEngine, Zero3OffloadEngine
from zerolab.zero0 import DataParallelEngine
from zerolab.zero1 import Zero1Engine
from zerolab.zero2 import Zero2Engine

ENGINES = {
    (0, None): DataParallelEngine,
    (1, None): Zero1Engine,
    (2, None): Zero2Engine,
    (3, None): HybridEngine,      # Zero3Engine itself unless given mesh / hpz / quantize_* (lesson 12)
    (1, "optimizer"): Zero1OffloadEngine,
    (2, "optimizer"): Zero2OffloadEngine,
    (3, "optimizer"): Zero3OffloadEngine,
    (1, "disk"): Zero1DiskEngine,          # ZeRO-Infinity's optimizer offload to disk (lesson 13)
    (2, "disk"): Zero2DiskEngine,
    (3, "disk"): Zero3DiskEngine,
}
STAGES = (0, 1, 2, 3)
OFFLOADS = (None, "optimizer", "disk")


def parse_stage(spec):
    """'2' -> (2, None); '2+offload' -> (2, 'optimizer'): the spelling of the demo and the benchmarks."""
    stage, _, extra = str(spec).partition("+")
    if stage not in tuple(map(str, STAGES)) or extra not in ("", "offload"):
        raise ValueError(f"stage {spec!r}: use 0, 1, 2, 3, optionally with +offload (e.g. 2+offload)")
    return int(stage), ("optimizer" if extra else None)


def initialize(model, *, stage=0, optimizer=torch.optim.AdamW, lr=1e-3, param_dtype=None, offload=None,
               bucket_bytes=25 * 2**20, reduce_impl=None, group=None, **options):
    """Wrap ``model`` in the engine for ``stage`` (0 = data parallel, 1/2/3 = ZeRO) on ``group``.

    ``optimizer`` is a class (built by the engine on what this rank owns), ``lr`` and the optimizer's
    own keywords (``weight_decay=...``) its arguments. ``param_dtype=torch.bfloat16`` trains in mixed
    precision: 2-byte params and grads for compute, fp32 master weights and Adam moments (K = 12).
    ``offload='optimizer'`` keeps the fp32 master, moments and gradient shard on the host
    (ZeRO-Offload; stages 1-3); ``offload='disk'`` keeps master and moments in a file in the folder
    ``offload_path`` and streams them through a few swap buffers at each step (ZeRO-Infinity; stages
    1-3; options ``swap_chunk``, ``buffer_count``, ``direct_io``: :mod:`zerolab.infinity`).
    ``bucket_bytes``: gradient bucket size for communication (stages 0 and 2). ``reduce_impl``: the reduce-scatter of stages 1-3, 'ring' (lesson 00's, from send/recv) or
    'torch'; default: torch's on NCCL, the ring on gloo. Every stage also takes ``loss_scale`` (None,
    "dynamic" or a number: fp16 loss scaling, GradScaler's rule) and ``reduce_dtype`` (the dtype
    gradients are reduced in; default the compute dtype; see :mod:`zerolab.mixed_precision`), and
    ``activation_checkpointing='full'`` or ``'selective'``: recompute each block, or each block's core
    attention, in backward (``checkpoint_units=[...]``: the modules to recompute, for models other
    than TinyGPT; lesson 10). Stage-specific options (stage 3: ``units``, ``prefetch``,
    ``persist_numel``, ``ops``, and for a model built on the meta device ``init_fn``, ``init_seed``:
    :mod:`zerolab.meta_init`; on a 2-D mesh, lesson 12: ``mesh=(nodes, devices per node)`` for
    HSDP, ``hpz=True``, ``quantize_weights=True``, ``quantize_gradients='int4'`` or ``'int8'``,
    ``quantize_block``: :mod:`zerolab.hybrid`) are keywords too. Raises ValueError naming any bad or unknown value and
    the valid ones. Every rank must call it with the same model (checked).
    """
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r} is not supported: choose one of {STAGES}")
    if offload not in OFFLOADS:
        raise ValueError(f"offload={offload!r} is not supported: choose one of {OFFLOADS}")
    if (stage, offload) not in ENGINES:
        raise ValueError(f"offload={offload!r} needs a sharded optimizer: use stage 1, 2 or 3 "
                         f"(ZeRO-Offload and ZeRO-Infinity offload each rank's partition)")
    check_common(model, stage=stage, optimizer=optimizer, lr=lr, param_dtype=param_dtype,
                 bucket_bytes=bucket_bytes, reduce_impl=reduce_impl, group=group)
    cls = ENGINES[(stage, offload)]
    stage_options, opt_kwargs = split_options(cls, options, optimizer,
                                              others=[(c.label(), c) for c in ENGINES.values() if c is not cls])
    check_same_model(model, group)
    return cls(model, optimizer=optimizer, opt_kwargs=dict(opt_kwargs, lr=lr), param_dtype=param_dtype,
               bucket_bytes=bucket_bytes, reduce_impl=reduce_impl, group=group, **stage_options)
