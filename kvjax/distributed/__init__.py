"""Multi-device kvjax: a ("data", "model") mesh, sharded parameters and KV state, sharded generation and
data-parallel training, over one process or several (`kvjax.distributed.launch` starts them). See docs/sharding.md."""

from kvjax.distributed.runtime import initialize
from kvjax.distributed.mesh import (
    AXES, ShardingPlan, local_model_mesh, make_mesh, mesh_from_text, param_specs, plan_for, shard_params,
)
from kvjax.distributed.state import init_sharded_state, shard_of, to_host
from kvjax.distributed.generation import MeshPlacement, generate_sharded, load_state_sharded, on_mesh, prefill_sharded
from kvjax.distributed.training import (
    accumulated_value_and_grad, data_parallel_value_and_grad, make_data_parallel_step, place_batch, replicate,
)

__all__ = [
    "AXES", "MeshPlacement", "ShardingPlan", "accumulated_value_and_grad", "data_parallel_value_and_grad",
    "generate_sharded", "init_sharded_state", "initialize", "load_state_sharded", "local_model_mesh", "make_data_parallel_step",
    "make_mesh", "mesh_from_text", "on_mesh", "param_specs", "place_batch", "plan_for", "prefill_sharded", "replicate",
    "shard_of", "shard_params", "to_host",
]
