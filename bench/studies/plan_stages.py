"""The planner's ranking with and without pipeline stages, for the multi-node targets: the best
recipe of each kind by estimated step time among those that fit by the analytic estimate, with
memory, the step-time parts and the bytes per device per step behind the comm terms. Estimates only (plan/search.py:evaluate); `main.py --plan` also
compiles the winner.

  python -m bench.studies.plan_stages [--targets=70b@64xH100-80GB,405b@512xH100-80GB]
"""
from absl import app, flags

_TARGETS = flags.DEFINE_list('targets', ['70b@64xH100-80GB', '405b@512xH100-80GB'],
                             'preset@target pairs.')


def main(argv):
  del argv
  from configs import default
  from plan.search import MARGIN, evaluate, host_fits, recipes
  from plan.target import parse_target

  print('| model @ target | stages allowed | recipes (fit) | best recipe | estimate GB/device | step s '
        '| compute s | DP comm s (GB) | TP comm s (GB) | pipeline comm s (GB) |')
  print('|---|---|---:|---|---:|---:|---:|---:|---:|---:|')
  for pair in _TARGETS.value:
    preset, target_name = pair.split('@')
    config, target = default.get_config(preset), parse_target(target_name)
    for stages in (False, True):
      candidates = [evaluate(config, r, target) for r in recipes(config, target, stages)]
      fitting = sorted((c for c in candidates if c.device_bytes <= target.memory * (1 - MARGIN)
                        and host_fits(c, target)), key=lambda c: c.seconds['total'])
      best_pipelined = next((c for c in fitting if c.recipe.stages > 1), None)
      for label, c in (('no', fitting[0] if fitting else None),
                       ('yes', fitting[0] if fitting else None),
                       ('yes, best with stages', best_pipelined)):
        if (label == 'no') != (not stages) or c is None:
          continue
        s = c.seconds
        print(f'| {pair} | {label} | {len(candidates)} ({len(fitting)}) | {c.recipe} '
              f'| {c.device_bytes / 1e9:.1f} | {s["total"]:.2f} | {s["compute"]:.2f} '
              f'| {s["data_parallel_comm"]:.2f} ({s["data_parallel_bytes"] / 1e9:.1f}) '
              f'| {s["tensor_comm"]:.2f} ({s["tensor_bytes"] / 1e9:.1f}) '
              f'| {s["pipeline_comm"]:.2f} ({s["pipeline_bytes"] / 1e9:.2f}) |')


if __name__ == '__main__':
  app.run(main)
