"""Multi-device kvjax: a ("data", "model") mesh, sharded parameters and KV state, sharded generation and
data-parallel training. See docs/sharding.md."""

from kvjax.distributed.mesh import AXES, ShardingPlan, make_mesh, param_specs, plan_for, shard_params
from kvjax.distributed.state import init_sharded_state, shard_of
from kvjax.distributed.generation import generate_sharded, prefill_sharded
from kvjax.distributed.training import (
    accumulated_value_and_grad, data_parallel_value_and_grad, make_data_parallel_step, place_batch, replicate,
)

__all__ = [
    "AXES", "accumulated_value_and_grad", "data_parallel_value_and_grad", "make_data_parallel_step", "place_batch",
    "replicate", "ShardingPlan", "generate_sharded", "init_sharded_state", "make_mesh", "param_specs",
    "plan_for", "prefill_sharded", "shard_of", "shard_params",
]
