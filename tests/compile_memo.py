"""The suite's workers keep each program they compile, and a test that compiles the same program
again is handed the one compiled before: the workers run on 8 XLA:CPU devices, which the
persistent compilation cache does not serve (train/compile_cache.py:unserved), and many tests
compile the same step (the tiny preset's, under one layout after another).

A program is the same when its module's text, its devices, its client and its compile options
are: what the compiler is given, so what it would return. The text leaves out the locations (the
tracing test's source lines and JAX's name scopes), which differ from test to test and reach only
the compiled program's metadata: a test reading a kept program's `op_name`s reads those of the
compile that made it. A kept executable is
the compiler's own object, not a copy written and read back (which is what hangs on jaxlib
0.10.2's XLA:CPU). Not kept: programs with host callbacks (they are bound to the Python functions
of the compile that made them). `SUITE_COMPILE_MEMO=0` turns it off; on a jax whose compiler has no
`backend_compile_and_load` it stays off.
"""
import collections
import hashlib
import os

_KEPT = 64   # executables kept, the least recently used dropped first
_memo: collections.OrderedDict = collections.OrderedDict()


def program_key(backend, module, executable_devices, options) -> tuple:
  """What makes two compiles the same program (the module's text, its devices, its client, its
  options)."""
  return (id(backend), tuple(d.id for d in executable_devices),
          hashlib.sha256(str(module).encode() + options.SerializeAsString()).digest())


def installed() -> bool:
  """Whether this process's backend compile is the memo's."""
  from jax._src import compiler
  return getattr(getattr(compiler, 'backend_compile_and_load', None), 'memoised', False)


def install() -> bool:
  """Wraps JAX's backend compile in this process; False where it stays off."""
  if os.environ.get('SUITE_COMPILE_MEMO', '1') == '0':
    return False
  from jax._src import compiler
  compile_and_load = getattr(compiler, 'backend_compile_and_load', None)
  if compile_and_load is None or installed():
    return False

  def memoised(backend, module, executable_devices, options, host_callbacks=(), *args, **kwargs):
    if host_callbacks or args or kwargs:
      return compile_and_load(backend, module, executable_devices, options, host_callbacks,
                              *args, **kwargs)
    key = program_key(backend, module, executable_devices, options)
    if key in _memo:
      _memo.move_to_end(key)
      return _memo[key]
    executable = compile_and_load(backend, module, executable_devices, options, host_callbacks)
    _memo[key] = executable
    if len(_memo) > _KEPT:
      _memo.popitem(last=False)
    return executable

  memoised.memoised = True
  compiler.backend_compile_and_load = memoised
  return True
