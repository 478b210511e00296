"""Process groups and collectives (seed steps 2, 5, 28, 31, 33)."""
from lane.distributed.parallel_state import (GroupCoordinator, get_ep_group, get_tp_group,
                                             init_distributed, set_model_parallel)

__all__ = ["GroupCoordinator", "get_ep_group", "get_tp_group", "init_distributed", "set_model_parallel"]
