"""Logical-axis rules: the table that turns logical names into mesh axes.

A parallel strategy is one of these tables; the model code never changes. A logical name mapped
to None is replicated; a name absent from the table is replicated too.
"""
from jax.sharding import PartitionSpec

# Activations: the batch is split over every data-parallel axis.
ACTIVATION_RULES = (
    ('batch', ('data', 'fsdp')),
    ('length', None),
)

# Parameters of a replicated (data-parallel) model.
REPLICATED_PARAM_RULES = (
    ('vocab', None),
    ('embed', None),
    ('heads', None),
    ('kv_heads', None),
    ('head_dim', None),
    ('mlp', None),
    ('layers', None),
)


def logical_rules() -> tuple:
  return ACTIVATION_RULES + REPLICATED_PARAM_RULES


def to_mesh_spec(logical_axes, rules) -> PartitionSpec:
  """('embed', 'mlp') -> PartitionSpec(...) under `rules`; a mesh axis is used at most once."""
  table = dict(rules)
  used, spec = set(), []
  for name in logical_axes:
    target = table.get(name)
    targets = (target,) if isinstance(target, str) else tuple(target or ())
    targets = tuple(t for t in targets if t not in used)
    used.update(targets)
    spec.append(targets[0] if len(targets) == 1 else (targets or None))
  return PartitionSpec(*spec)
