"""What a run is set up as (`train/run.py:setup` builds it): the config, the model and its
precision, the mesh and its rules, the state's layout, the jitted step, the batches' placement and
the pipeline's schedule. Its own module so that the parts of a run (init_from, loop, summary) and
the benchmarks can name its type without importing the run."""
import contextlib
import dataclasses
import math

import jax
from flax import linen

from models.attention import compiling_for
from models.config import ModelConfig
from models.hints import weights_split_over_data
from parallel.pipeline import PipelineSchedule, pipelined
from parallel.pipeline_1f1b import OneFOneB
from parallel.pipeline_zb import ZeroBubble
from parallel.rules import SHARDED, ZERO_AXES, LayoutRules
from precision.policy import Policy
from train.state import ModelSpec, StateLayout


@dataclasses.dataclass
class Setup:
  config: object
  spec: ModelSpec           # the model, its precision, adapters and frozen-base storage
  model: ModelConfig
  policy: Policy
  mesh: jax.sharding.Mesh
  rules: LayoutRules
  layout: StateLayout
  train_step: object        # jitted, with shardings and donation
  batch_sharding: jax.sharding.NamedSharding
  block_axes: dict | None   # 8-bit Adam: parameter path -> the dimension its moments are blocked from
  pipeline: PipelineSchedule | None = None   # mesh.stage > 1
  feed: tuple[int, int] = (0, 1)   # this process feeds block `feed[0]` of `feed[1]` of the batch rows

  @property
  def stack(self):
    """How the blocks run in the train and eval steps: through the pipeline, or one after another."""
    return pipeline_stack(self.pipeline, self.config, self.rules)

  @property
  def platform(self) -> str:
    """What the step is compiled for: `gpu` for a GPU target compiled on a CPU."""
    return self.mesh.devices.flat[0].platform

  def context(self):
    """Trace-time context: the mesh, the rules that turn activation hints into shardings, the
    platform compiled for, and whether the weights are stored split over the data-parallel
    devices."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(self.mesh))
    stack.enter_context(linen.logical_axis_rules(self.rules.activations))
    stack.enter_context(compiling_for(self.platform))
    # Split where ZeRO-3 spreads them over more than one device (as the estimate's
    # `gathers_params`): over one, nothing is gathered and the weights are whole.
    zero_devices = math.prod(self.mesh.shape[axis] for axis in ZERO_AXES)
    stack.enter_context(weights_split_over_data(self.rules.params == SHARDED and zero_devices > 1))
    return stack


def pipeline_stack(schedule: PipelineSchedule | None, config, rules=None):
  """How the blocks run under `schedule`: the backward pass inside the pipeline's loop (1f1b:
  its gradients placed by the layout's `rules`, ZeRO-3's weights gathered once per step, a
  chunk's backward in a loop under remat), or after all forwards (gpipe,
  circular); None (one stage): one after another."""
  if schedule is None:
    return None
  rolled_backward = config.model.remat != 'none'
  if schedule.zero_bubble:
    return ZeroBubble(schedule, rules, rolled_backward=rolled_backward)
  if schedule.backward_in_loop:
    return OneFOneB(schedule, rules, rolled_backward=rolled_backward)
  return pipelined(schedule, gather_once=config.parallel.get('pipeline_gather_once', False))
