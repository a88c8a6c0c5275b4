"""The census (sitecustomize.py, jaxtimes.py) per test file: the tests' own wall and CPU seconds
and the processes they started, each with the seconds JAX spent tracing, lowering and compiling;
then when each pytest worker ended, against the other, and what the workers compiled twice.

  python tests/census/summary.py [/tmp/suite-census.jsonl]"""
import collections
import json
import sys

EVENTS = {'trace': '/jax/core/compile/jaxpr_trace_duration',
          'lower': '/jax/core/compile/jaxpr_to_mlir_module_duration',
          'compile': '/jax/core/compile/backend_compile_duration'}
COLUMNS = ('wall', 'cpu', *EVENTS)


def totals(rows) -> collections.Counter:
  out = collections.Counter()
  for row in rows:
    out['wall'] += row['wall_s']
    out['cpu'] += row['cpu_s']
    for name, event in EVENTS.items():
      out[name] += row['events_s'].get(event, 0.0)
  return out


def main(path: str) -> None:
  with open(path) as f:
    rows = [json.loads(line) for line in f]
  by_file = collections.defaultdict(lambda: {'test': [], 'process': []})
  for row in rows:
    if row['kind'] in ('test', 'process'):   # the pytest and server rows are whole lives
      by_file[row['test'].split('::')[0]][row['kind']].append(row)
  print(f'{"":42} {"tests (s)":^34} | {"processes they started (s)":^40}')
  print(f'{"file":42} ' + ' '.join(f'{c:>6}' for c in COLUMNS) + f' | {"n":>3} '
        + ' '.join(f'{c:>6}' for c in COLUMNS))
  order = sorted(by_file, key=lambda k: -(totals(by_file[k]['test'])['wall']
                                          + totals(by_file[k]['process'])['cpu']))
  for name in order + ['all']:
    kinds = by_file[name] if name != 'all' else {
        kind: [r for r in rows if r['kind'] == kind] for kind in ('test', 'process')}
    own, started = totals(kinds['test']), totals(kinds['process'])
    print(f'{name[:42]:42} ' + ' '.join(f'{own[c]:6.0f}' for c in COLUMNS)
          + f' | {len(kinds["process"]):3d} ' + ' '.join(f'{started[c]:6.0f}' for c in COLUMNS))
  _lives(rows)
  _worker_ends([r for r in rows if r['kind'] == 'test' and 'start' in r])
  _repeated_compiles([r for r in rows if r['kind'] == 'test' and 'compiles' in r])


def _lives(rows) -> None:
  """Each pytest process's whole CPU and what it reaped, and each warm server's subtree: the
  CPU that no test's line holds is the difference."""
  for row in rows:
    if row['kind'] == 'pytest':
      print(f'pytest {row["worker"]}: {row["cpu_s"]:.0f} CPU-s itself, {row["children_cpu_s"]:.0f} '
            f'CPU-s in the processes it reaped, {row["wall_s"]:.0f} s of wall')
  servers = collections.Counter()
  for row in rows:
    if row['kind'] == 'server':
      servers[row['worker']] += row['subtree_cpu_s']
  for worker, seconds in sorted(servers.items()):
    print(f'warm servers of {worker}: {seconds:.0f} CPU-s, with the commands they served')


def _worker_ends(tests) -> None:
  """When each worker ran its first and last test: a core idle at the end shows as an early end."""
  if not tests:
    return
  first = min(r['start'] for r in tests)
  print()
  for worker in sorted({r['worker'] for r in tests}):
    own = sorted((r for r in tests if r['worker'] == worker), key=lambda r: r['start'])
    last = own[-1]
    print(f'{worker}: {len(own)} tests, busy {sum(r["wall_s"] for r in own):.0f} s, ends at '
          f'{last["start"] + last["wall_s"] - first:.0f} s after the first start (last: '
          f'{last["test"]}, {last["wall_s"]:.1f} s)')


def _repeated_compiles(tests) -> None:
  """The workers' compiles of a program they had compiled before (jaxtimes.py keys each by its
  module, devices and options): what the workers' memo (tests/compile_memo.py) serves, by file,
  in a census run with SUITE_COMPILE_MEMO=0."""
  if not tests:
    return
  seen, repeated, by_file = set(), [0, 0.0], collections.Counter()
  total = sum(seconds for r in tests for _, seconds in r['compiles'])
  for r in sorted(tests, key=lambda r: r['start']):
    for key, seconds in r['compiles']:
      if (r['worker'], key) in seen:
        repeated[0] += 1
        repeated[1] += seconds
        by_file[r['test'].split('::')[0]] += seconds
      seen.add((r['worker'], key))
  print(f'\nthe workers compiled {sum(len(r["compiles"]) for r in tests)} programs in {total:.0f} s; '
        f'{repeated[0]} of them ({repeated[1]:.0f} s) they had compiled before:')
  for name, seconds in by_file.most_common(10):
    print(f'  {name}: {seconds:.0f} s')


if __name__ == '__main__':
  try:
    main(sys.argv[1] if len(sys.argv) > 1 else '/tmp/suite-census.jsonl')
  except BrokenPipeError:   # | head
    pass
