"""The import graph of the project's code (ARCHITECTURE.md): no circles, and each folder imports
only the folders below it. Imports inside functions count: a circle hidden in a function is still
a circle. And the rules that are written once (the ZeRO table, the HLO dtype sizes, the reader of
metrics.jsonl): a second copy would be found here."""
import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Folder (or top-level module) -> the project folders it may import, besides itself.
ALLOWED = {
    'configs': set(),
    'quant': set(),
    'precision': {'quant'},
    'models': {'precision', 'quant'},
    'optim': {'quant'},
    'parallel': set(),
    'data': set(),
    'memory': {'models', 'precision', 'quant', 'parallel'},
    'convert': {'models'},
    'train': {'configs', 'quant', 'precision', 'models', 'optim', 'parallel', 'data', 'memory',
              'convert'},
    'plan': {'configs', 'quant', 'precision', 'models', 'parallel', 'memory', 'train'},
}
TOP = ('bench', 'cli', 'main', 'sweep', 'sweeps')   # drivers: may import everything
SKIP = ('tests', 'runs', '.git', '__pycache__', '.pytest_cache', '.ci')


def project_modules() -> dict[str, str]:
  """Dotted module name -> file, for every Python file outside the tests."""
  found = {}
  for folder, dirs, files in os.walk(ROOT):
    # Hidden folders are not the project's: .git, and the README's .venv-* environments.
    dirs[:] = [d for d in dirs if d not in SKIP and not d.startswith('.')]
    for name in files:
      if name.endswith('.py'):
        path = os.path.join(folder, name)
        module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, '.')
        found[module.removesuffix('.__init__')] = path
  return found


def imports(path: str, modules: dict) -> set[str]:
  """The project modules a file imports (a `from package import name` of a submodule counts as
  that submodule)."""
  with open(path, encoding='utf-8') as f:
    tree = ast.parse(f.read())
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names if a.name in modules)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
      subs = {f'{node.module}.{a.name}' for a in node.names} & set(modules)
      out.update(subs or {node.module})
  return out


def import_graph() -> dict[str, set[str]]:
  modules = project_modules()
  return {m: imports(path, modules) - {m} for m, path in modules.items()}


def test_every_folder_imports_only_the_folders_below_it():
  folders = {m.split('.')[0] for m in project_modules()}
  assert folders - set(ALLOWED) - set(TOP) == set(), 'a new folder needs its row in ALLOWED'
  upward = []
  for module, targets in import_graph().items():
    folder = module.split('.')[0]
    if folder in TOP:
      continue
    upward += [f'{module} -> {t}' for t in targets
               if t.split('.')[0] not in ALLOWED[folder] | {folder}]
  assert upward == []


def test_nothing_imports_the_studies():
  """bench/studies/ holds one-off studies, not maintained as tools: no kept module relies on one
  (the tests that keep them working may)."""
  found = [f'{module} -> {t}' for module, targets in import_graph().items()
           if not module.startswith('bench.studies')
           for t in targets if t.startswith('bench.studies')]
  assert found == []


def test_the_import_graph_has_no_circles():
  graph = import_graph()
  state, circles = {}, []

  def visit(module, trail):
    state[module] = 'open'
    for target in sorted(graph[module]):
      if state.get(target) == 'open':
        circles.append(' -> '.join(trail[trail.index(target):] + [target]))
      elif target not in state:
        visit(target, trail + [target])
    state[module] = 'done'

  for module in sorted(graph):
    if module not in state:
      visit(module, [module])
  assert circles == []


def test_the_checker_sees_a_circle_and_an_upward_import(tmp_path, monkeypatch):
  """The two tests above can fail: a planted circle and an upward import are found."""
  graph = {'quant.a': {'models.b'}, 'models.b': {'quant.a'}}
  monkeypatch.setattr(f'{__name__}.import_graph', lambda: graph)
  monkeypatch.setattr(f'{__name__}.project_modules', lambda: dict.fromkeys(graph, ''))
  for test in (test_every_folder_imports_only_the_folders_below_it,
               test_the_import_graph_has_no_circles):
    try:
      test()
    except AssertionError:
      continue
    raise AssertionError(f'{test.__name__} passed on a broken graph')


def test_metrics_jsonl_is_read_in_one_place():
  """Every reader of a run's metrics.jsonl goes through train/metrics.py:read_rows, which leaves
  out a torn line; a second reader that opens the file itself would drift from it."""
  readers = []
  for module, path in project_modules().items():
    if module == 'train.metrics':
      continue
    with open(path, encoding='utf-8') as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if isinstance(node, ast.Call) and getattr(node.func, 'id', None) == 'open' and any(
          isinstance(n, ast.Constant) and n.value == 'metrics.jsonl' for n in ast.walk(node)):
        readers.append(f'{module}:{node.lineno}')
  assert readers == []


def _sources_except(owner: str):
  """(module, source text) of every project module but `owner`."""
  for module, path in project_modules().items():
    if module != owner:
      with open(path, encoding='utf-8') as f:
        yield module, f.read()


def test_the_zero_stages_are_written_in_one_table():
  """What each ZeRO stage shards is parallel/rules.py:SHARDED_FROM; a comparison of a stage number
  elsewhere (`zero_stage >= 2`) would be a second copy of that table."""
  copies = [f'{module}: {m.group(0)}' for module, text in _sources_except('parallel.rules')
            for m in re.finditer(r'zero_stage\s*(?:>=|<=|>|<)\s*\d|zero_stage\s+(?:not\s+)?in\s*\(',
                                 text)]
  assert copies == []


def test_hlo_dtype_sizes_are_written_in_one_place():
  """Every reader of HLO text sizes its arrays through parallel/hlo_arrays.py; a table of dtype
  sizes elsewhere would drift from it (three did: s4 was 1 byte in one, half a byte in another)."""
  copies = [f'{module}: {m.group(0)}' for module, text in _sources_except('parallel.hlo_arrays')
            for m in re.finditer(r"""['"](?:bf16|f32|s8)['"]\s*:\s*\d""", text)]
  assert copies == []


def test_the_library_defines_no_command_line():
  """The programs a user types live in cli/ (and main.py, bench/, sweep/): the library below them
  defines no absl flag, so importing it never claims a flag name, and train/ holds no program
  (its old program names only hand over to cli/)."""
  claims = [f'{module}: {m.group(0)}' for module, text in _sources_except(None)
            if module.split('.')[0] in ALLOWED for m in re.finditer(r'flags\.DEFINE_\w+', text)]
  parsers = [module for module, text in _sources_except(None)
             if module.startswith('train.') and 'argparse' in text]
  assert claims == [] and parsers == []
