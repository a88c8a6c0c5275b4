"""Python's cyclic garbage collector, set for a process that imports JAX and traces programs.

With CPython's defaults (a young collection every 700 net allocations; every tenth of those an older
one, and every hundredth a full one that walks every tracked object) a process that imports the
library, sets up the tiny preset's step and compiles it spends a sixth of its CPU in the collector
(`perf`; a tenth to a fifth of a `main.py` start is what `settle` saves), mostly walking the modules
of jax, flax, orbax and grain, which live as long as the process, while tracing allocates in bursts.
`settle()`, called once those modules are imported, moves every object alive then out of the
collector's sight (`gc.freeze`) and makes young collections rarer. Reference counting still frees at
once what is in no cycle; cycles are still found, later.
"""
import gc

YOUNG_COLLECTION_EVERY = 10_000   # net allocations (CPython's default: 700)


def settle() -> None:
  """Freeze what is alive now (imported modules and what they built), after one collection so that
  no garbage of the imports is frozen with it, and space young collections."""
  gc.collect()
  gc.freeze()
  _, older, oldest = gc.get_threshold()
  gc.set_threshold(YOUNG_COLLECTION_EVERY, older, oldest)
