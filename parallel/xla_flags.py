"""The XLA flags a training run gets by default on an NVIDIA GPU: those that MaxText's GPU scripts
(end_to_end/gpu/a3/test_llama2_7b.sh) and the JAX GPU performance guide set for training. A flag the
user's XLA_FLAGS already sets keeps the user's value; nothing is added when JAX will not run on a
CUDA GPU. XLA reads XLA_FLAGS once, when the backend starts: `apply` must run before that.
`step_options` are the options one program, the train step of a layout, compiles with on top."""
import glob
import importlib.util
import os
import shlex

# Each exists in the XLA of jaxlib 0.10.2, 0.11.2 and 0.12.0.1 (an unknown flag aborts the process)
# and changes scheduling and the grouping of collectives, never the numerics. Command buffers (CUDA
# graphs) are left at XLA's default, which already captures fusions and cuBLAS/cuDNN calls.
GPU_TRAINING_FLAGS = (
    # Overlap the FSDP all-gathers and gradient reduce-scatters with the next layers' matmuls.
    ('xla_gpu_enable_latency_hiding_scheduler', 'true'),
    # Combine the per-tensor collectives into fewer, larger ones (MaxText's Llama-2-7B sizes).
    ('xla_gpu_all_gather_combine_threshold_bytes', '134217728'),
    ('xla_gpu_reduce_scatter_combine_threshold_bytes', '67108864'),
    ('xla_gpu_all_reduce_combine_threshold_bytes', '134217728'),
    # In the scanned layer loop, fetch the next layer's weights and send the previous layer's
    # gradients while the current layer computes.
    ('xla_gpu_enable_pipelined_all_gather', 'true'),
    ('xla_gpu_enable_pipelined_reduce_scatter', 'true'),
    ('xla_gpu_enable_pipelined_all_reduce', 'true'),
)

# ZeRO-1/2 store the weights whole and update them in shards: after the update each new weight is
# all-gathered once. Uncombined, XLA:GPU holds at most one gathered stack in the temp at a time (the
# others go into their donated old weights' buffers, where the shards are not padded); combined
# with others (a 100m preset's 108 MiB stacks fit the 128 MiB threshold with the small leaves), the
# combined gather's result is in the temp, and at 64 devices the gather before it too: 100m ZeRO-2
# on 64 H100s 0.613 -> 0.506 GiB a device. They run once a step, so not combining them costs a
# collective's latency per weight; no layer's weights are gathered in the passes (ZeRO-3 gathers
# them there, and its steps keep the combiner), nor, without context parallelism, anything else.
UNCOMBINED_GATHERS = (('xla_gpu_all_gather_combine_threshold_bytes', '1'),)


# The PJRT plugin (jax-cuda12-pjrt / jax-cuda13-pjrt) and the kernels package of `jax[cuda12]`,
# `jax[cuda13]`.
CUDA_PLUGINS = ('jax_plugins.xla_cuda12', 'jax_plugins.xla_cuda13', 'jax_cuda12_plugin',
                'jax_cuda13_plugin')


def flag_names(xla_flags: str) -> set[str]:
  """The names of the flags an XLA_FLAGS value sets (`--name=value` or a bare `--name`)."""
  return set(flag_values(xla_flags))


def flag_values(xla_flags: str) -> dict[str, str]:
  """The flags an XLA_FLAGS value sets, name -> value (a bare `--name`: 'true')."""
  try:
    words = shlex.split(xla_flags)
  except ValueError:
    words = xla_flags.split()   # an unbalanced quote: XLA will say so itself
  pairs = (w[2:].split('=', 1) for w in words if w.startswith('--'))
  return {p[0]: (p[1] if len(p) > 1 else 'true') for p in pairs}


def merged(xla_flags: str, defaults=GPU_TRAINING_FLAGS) -> tuple[str, list[str]]:
  """`xla_flags` with each default it does not set appended; and those appended (`--name=value`)."""
  present = flag_names(xla_flags)
  added = [f'--{name}={value}' for name, value in defaults if name not in present]
  return ' '.join([xla_flags.strip(), *added]).strip(), added


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except (ImportError, ValueError):   # a parent package that is not there
    return False


def cuda_expected(platforms: str | None, environ=os.environ) -> bool:
  """Whether JAX will start on a CUDA GPU, judged without starting a backend: a CUDA plugin is
  installed, `platforms` (jax_platforms / JAX_PLATFORMS; None or '' = JAX's choice) allows CUDA,
  CUDA_VISIBLE_DEVICES does not hide every device, and the driver shows a device."""
  if platforms and not {'cuda', 'gpu'} & {p.strip() for p in platforms.split(',')}:
    return False
  if environ.get('CUDA_VISIBLE_DEVICES', None) in ('', '-1'):
    return False
  if cuda_plugin() is None:
    return False
  return bool(glob.glob('/dev/nvidia[0-9]*')) or os.path.exists('/dev/dxg')   # /dev/dxg: WSL 2


def cuda_plugin() -> str | None:
  """The installed CUDA plugin's module (None: none is)."""
  return next((m for m in CUDA_PLUGINS if _installed(m)), None)


def cuda_plugin_without_gpu(environ=os.environ) -> bool:
  """A CUDA plugin is installed where JAX will not find a CUDA GPU (a CPU machine that compiles
  for GPU targets)."""
  return cuda_plugin() is not None and not cuda_expected(None, environ)


def apply(platforms: str | None, environ=os.environ) -> list[str]:
  """Adds the GPU training defaults the user's XLA_FLAGS leaves unset, when JAX will run on a CUDA
  GPU; returns the flags added (none on any other backend)."""
  if not cuda_expected(platforms, environ):
    return []
  value, added = merged(environ.get('XLA_FLAGS', ''))
  if added:
    environ['XLA_FLAGS'] = value
  return added


def step_options(platform: str, gathers_new_weights: bool, environ=os.environ) -> dict[str, str]:
  """The XLA options the train step compiles with beyond XLA_FLAGS, on `platform` (a device's:
  'gpu' for a GPU, compile-only ones included), for a step whose only all-gathers are its new
  weights' after the update (ZeRO-1/2 over more than one ZeRO shard, without context parallelism:
  train/run.py). None off the GPU; none that XLA_FLAGS sets to a value of the user's own (one
  other than the training default that `apply` and the target's `prepare` write there; the
  default itself, written by hand, is taken for theirs)."""
  if platform != 'gpu' or not gathers_new_weights:
    return {}
  user = flag_values(environ.get('XLA_FLAGS', ''))
  defaults = dict(GPU_TRAINING_FLAGS)
  return {name: value for name, value in UNCOMBINED_GATHERS
          if user.get(name, defaults.get(name)) == defaults.get(name)}
