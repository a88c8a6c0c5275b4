"""Reading a `jax.profiler` trace back: its complete events with their thread's and process's
names, and the time a set of intervals covers. Defines no flags."""
import glob
import gzip
import json
import os


def read_trace(directory: str) -> list[dict]:
  """The complete ('X') events of the newest trace under `directory`, times in µs, each with
  its thread's and its process's name (`/device:GPU:0` for a GPU's kernels)."""
  files = sorted(glob.glob(os.path.join(directory, '**', '*.trace.json.gz'), recursive=True),
                 key=os.path.getmtime)
  if not files:
    raise RuntimeError(f'jax.profiler wrote no trace under {directory}')
  with gzip.open(files[-1]) as f:
    events = json.load(f)['traceEvents']
  threads = {(e['pid'], e.get('tid')): e['args']['name'] for e in events
             if e.get('ph') == 'M' and e.get('name') == 'thread_name'}
  processes = {e['pid']: e['args']['name'] for e in events
               if e.get('ph') == 'M' and e.get('name') == 'process_name'}
  return [{**e, 'thread': threads.get((e['pid'], e.get('tid')), ''),
           'process': processes.get(e['pid'], '')}
          for e in events if e.get('ph') == 'X' and 'dur' in e]


def union_us(intervals) -> float:
  """Total length covered by [start, end) intervals."""
  total, reach = 0.0, float('-inf')
  for start, end in sorted(intervals):
    if end > reach:
      total += end - max(start, reach)
      reach = end
  return total
