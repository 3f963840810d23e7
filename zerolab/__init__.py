"""zerolab: data parallelism and ZeRO stages 1-3 and CPU offload, on real process groups.

The public API, by lesson:
    00  launch, Cluster, RankError, RankTimeout, rank_device, rank_state, init_from_env; zerolab.comm
    02  initialize (the engine for every stage), DataParallel
    03  Zero1Optimizer (ZeroRedundancyOptimizer-shaped)
    07  zerolab.cost, zerolab.calibrate, zerolab.demo (also `zerolab demo`)
    09  engine.save_checkpoint / load_checkpoint, zerolab.checkpoint.consolidate
    10  initialize(..., activation_checkpointing='full' | 'selective'), engine.activation_report();
        zerolab.activations
    11  fully_shard (ZeRO-3 in your own loop), clip_grad_norm_ (for it), LossScaler;
        initialize(..., loss_scale=, reduce_dtype=), engine.clip_grad_norm_
    13  initialize(..., offload='disk', offload_path=...) (ZeRO-Infinity); zerolab.tiers,
        zerolab.bandwidth_centric, zerolab.tiling, zerolab.prefetch
"""
from zerolab.launch import (Cluster, RankError, RankTimeout, init_from_env, launch, rank_device,
                            rank_state)

__version__ = "0.1.0"

# Imported on first use, so that `import zerolab` stays free of torch: the grader's parent process
# and the launcher import it before any rank exists. Each name's import is written out (no import
# by string): tools and readers see where it comes from.
__all__ = ["Cluster", "RankError", "RankTimeout", "init_from_env", "launch", "rank_device", "rank_state",
           "initialize", "DataParallel", "Zero1Optimizer", "fully_shard", "clip_grad_norm_", "LossScaler"]


def __getattr__(name):
    if name == "initialize":
        from zerolab.stages import initialize
        return initialize
    if name == "DataParallel":
        from zerolab.data_parallel import DataParallel
        return DataParallel
    if name == "Zero1Optimizer":
        from zerolab.zero1 import Zero1Optimizer
        return Zero1Optimizer
    if name == "fully_shard":
        from zerolab.fully_sharded import fully_shard
        return fully_shard
    if name == "clip_grad_norm_":
        from zerolab.fully_sharded import clip_grad_norm_
        return clip_grad_norm_
    if name == "LossScaler":
        from zerolab.mixed_precision import LossScaler
        return LossScaler
    raise AttributeError(f"module 'zerolab' has no attribute {name!r}")
