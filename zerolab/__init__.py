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
"""
from zerolab.launch import (Cluster, RankError, RankTimeout, init_from_env, launch, rank_device,
                            rank_state)

__version__ = "0.1.0"

# Imported on first use: `import zerolab` stays light for the ranks' start-up.
_LAZY = {"initialize": "zerolab.stages", "DataParallel": "zerolab.data_parallel",
         "Zero1Optimizer": "zerolab.zero1", "fully_shard": "zerolab.fully_sharded",
         "clip_grad_norm_": "zerolab.fully_sharded", "LossScaler": "zerolab.mixed_precision"}

__all__ = ["Cluster", "RankError", "RankTimeout", "init_from_env", "launch", "rank_device",
           "rank_state", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zerolab' has no attribute {name!r}")
