"""The census (sitecustomize.py, jaxtimes.py) per test file: the tests' own wall and CPU seconds
and the processes they started, each with the seconds JAX spent tracing, lowering and compiling.

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


if __name__ == '__main__':
  try:
    main(sys.argv[1] if len(sys.argv) > 1 else '/tmp/suite-census.jsonl')
  except BrokenPipeError:   # | head
    pass
