"""zerolab: data parallelism and ZeRO stages 1-3 and CPU offload, on real process groups."""
from zerolab.launch import (Cluster, RankError, RankTimeout, init_from_env, launch, rank_device,
                            rank_state)

__version__ = "0.1.0"
__all__ = ["Cluster", "RankError", "RankTimeout", "init_from_env", "launch", "rank_device", "rank_state"]
