"""The guides cannot rot: every command in README.md and docs/ runs, and what they name exists.

A shell block (```sh) is run line by line, in order, in one scratch directory per guide that links
the project's `main.py`, `configs/` and `sweeps/` (so `runs/`, `prepared/` and the like land there,
never in the project, and later blocks of the same guide see what earlier ones wrote). An HTML comment just above a block says how the test runs it:

  <!-- doc-test: preset=tiny --config.train.steps=2 bench.ptq:--flag=x fixture=corpus expect=REGEX -->

- `preset=P`: every `--config=configs/X.py[:Q]` becomes `configs/X.py:P` (the real preset would take
  long; the flags and the code path are the same);
- `--flag`: appended to every `python main.py` line (absl keeps the last value given);
- `MODULE:--flag`: appended to every `python -m MODULE` line;
- `fixture=corpus` or `fixture=hf_llama`: what the block reads, made first (text, JSON Lines and
  Parquet files under `corpus/`; a two-layer random Llama at `hf-models/Llama-3.2-1B`);
- `expect=REGEX`: the block's output must match;
- `needs=MODULE`: run only where MODULE imports (torch is a test requirement of the pinned stack
  only);
- `skip REASON`: not run (a SLURM script, the suite itself, CUDA wheels); the reason is required;
- `run-by=tests/FILE.py`: run by that file's test, which checks what it writes
  (`run_documented(guide, command, directory)`), rather than a second time here.

`pip install -r FILE` is not run (CI installs from nothing); the file must exist. Inline code in the
prose may name a command (`python -m data.prepare`) but not give its flags: commands with flags
live in blocks, where they are run. Config keys (`--config.model.remat`), repository paths and
local links (with their `#anchor`) named anywhere in the guides must exist.
"""
import os
import re
import shlex
import subprocess
import sys

import pytest
from ml_collections import config_dict

from tests import warm_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDES = ['README.md'] + sorted(os.path.join('docs', f) for f in os.listdir(os.path.join(ROOT, 'docs'))
                                if f.endswith('.md'))
FENCE = re.compile(r'^```(\S*)\s*$')
DIRECTIVE = re.compile(r'^<!-- doc-test: (.*) -->$')
SCREEN = 45   # lines in README's first screen


def _read(guide: str) -> list[str]:
  with open(os.path.join(ROOT, guide), encoding='utf-8') as f:
    return f.read().split('\n')


def blocks(guide: str) -> list[dict]:
  """Each fenced block: its info string, first line number, lines, and the directive above it."""
  lines, found, i = _read(guide), [], 0
  while i < len(lines):
    m = FENCE.match(lines[i])
    if not m:
      i += 1
      continue
    end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith('```'))
    above = DIRECTIVE.match(lines[i - 1]) if i else None
    found.append(dict(kind=m.group(1), line=i + 1, body=lines[i + 1:end],
                      directive=shlex.split(above.group(1)) if above else []))
    i = end + 1
  return found


def commands(body: list[str]) -> list[str]:
  """The block's commands: continuations joined, comments and SLURM headers left out."""
  out = []
  text = '\n'.join(body).replace('\\\n', ' ')
  for line in text.split('\n'):
    line = line.strip()
    if line and not line.startswith('#'):
      out.append(line)
  return out


def _shell_line(command: str, directive: list[str], python: list[str]) -> str:
  """One documented command as the test runs it (see the module's docstring), `python` run by
  the words `python`."""
  preset = next((t.split('=', 1)[1] for t in directive if t.startswith('preset=')), None)
  main_args = [t for t in directive if t.startswith('--')]
  module_args = [t.split(':', 1) for t in directive if re.match(r'^[a-z_.]+:--', t)]
  background = command.endswith('&')
  command = command.rstrip('&').strip()
  parts = []
  for part in command.split(' && '):
    words = shlex.split(part)
    if words[:3] == ['pip', 'install', '-r']:
      assert os.path.exists(os.path.join(ROOT, words[3])), f'{part}: no {words[3]}'
      continue
    assert words[0] == 'python', f'not a python command: {part}'
    if preset:
      words = [re.sub(r'^(--config=configs/\w+\.py)(:\w+)?$', rf'\1:{preset}', w) for w in words]
    if words[1] == 'main.py':
      words += main_args
    elif words[1] == '-m':
      words += [arg for module, arg in module_args if module == words[2]]
    parts.append(shlex.join(python + words[1:]))
  line = ' && '.join(parts)
  return f'{line} & pids+=($!)' if background else line


def _make_corpus(directory: str) -> None:
  """Text files (standard-library modules), a gzipped JSON Lines file and a Parquet file."""
  import gzip
  import json
  import sysconfig

  import pyarrow as pa
  import pyarrow.parquet as pq
  stdlib = sysconfig.get_paths()['stdlib']
  sources = sorted(os.path.join(stdlib, 'json', f) for f in os.listdir(os.path.join(stdlib, 'json'))
                   if f.endswith('.py'))
  sources += sorted(os.path.join(stdlib, 'email', f) for f in os.listdir(os.path.join(stdlib, 'email'))
                    if f.endswith('.py'))
  os.makedirs(os.path.join(directory, 'corpus'))
  texts = []
  for path in sources:
    with open(path, encoding='utf-8') as f:
      texts.append(f.read())
    name = os.path.relpath(path, stdlib).replace(os.sep, '_').replace('.py', '.txt')
    with open(os.path.join(directory, 'corpus', name), 'w', encoding='utf-8') as f:
      f.write(texts[-1])
  with gzip.open(os.path.join(directory, 'corpus', 'records.jsonl.gz'), 'wt', encoding='utf-8') as f:
    for text in texts[:12]:
      f.write(json.dumps({'text': text}) + '\n')
  pq.write_table(pa.table({'text': texts[12:24]}), os.path.join(directory, 'corpus', 'records.parquet'))


def _make_hf_llama(directory: str) -> None:
  torch = pytest.importorskip('torch', reason='needs torch and transformers (requirements-test.txt)')
  transformers = pytest.importorskip('transformers')
  torch.manual_seed(0)
  config = transformers.LlamaConfig(
      vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
      rope_theta=10000.0, tie_word_embeddings=False)
  transformers.LlamaForCausalLM(config).save_pretrained(os.path.join(directory, 'hf-models', 'Llama-3.2-1B'))


def _importable(module: str) -> bool:
  try:
    __import__(module)
    return True
  except ImportError:
    return False


FIXTURES = {'corpus': _make_corpus, 'hf_llama': _make_hf_llama}
FIXTURE_PATHS = {'corpus': 'corpus', 'hf_llama': 'hf-models'}   # what each makes


LINKED = ('main.py', 'configs', 'sweeps')   # what the guides name by a relative path


def _sandbox(directory: str) -> dict:
  """A scratch directory where the guides' relative paths work and every output stays: the
  project's packages come from PYTHONPATH, and only what is read by path is linked in."""
  for name in LINKED:
    link = os.path.join(directory, name)
    if not os.path.islink(link):   # a second block in the same directory finds them there
      os.symlink(os.path.join(ROOT, name), link)
  path = os.environ.get('PYTHONPATH')
  return {**os.environ, 'PYTHONPATH': ROOT + (os.pathsep + path if path else '')}


def _run_block(guide: str, block: dict, directory, directive: list[str]) -> str:
  """One block's commands, as the module's docstring says, in `directory`: its output. Fails the
  test where a command fails or an `expect=` is not in the output."""
  where, env = f'{guide}:{block["line"]}', _sandbox(str(directory))
  for token in directive:
    name = token.split('=', 1)[1] if token.startswith('fixture=') else None
    if name and not os.path.exists(os.path.join(directory, FIXTURE_PATHS[name])):
      FIXTURES[name](str(directory))
  script = ['set -euo pipefail', 'pids=()']
  python = warm_python.command(env) if warm_python.ENABLED else [sys.executable]
  script += [_shell_line(c, directive, python) for c in commands(block['body'])]
  script += ['for p in "${pids[@]}"; do wait "$p"; done']
  result = subprocess.run(['bash', '-c', '\n'.join(script)], cwd=directory, env=env,
                          capture_output=True, text=True, timeout=900)
  output = result.stdout + result.stderr
  assert result.returncode == 0, f'{where} failed (exit {result.returncode}):\n{output[-3000:]}'
  for token in directive:
    if token.startswith('expect='):
      assert re.search(token.split('=', 1)[1], output), f'{where}: no {token} in\n{output[-3000:]}'
  return output


def run_documented(guide: str, command: str, directory, *extra: str) -> str:
  """Runs the block of `guide` that holds `command` and says `run-by=` the calling test's file, in
  `directory`, with `extra` directive tokens (e.g. 'bench.profile:--out=profile.json'): its
  output. So one process serves both the guide and a test that asserts more about what it writes."""
  block = next((b for b in blocks(guide) if b['kind'] == 'sh' and command in commands(b['body'])),
               None)
  assert block is not None, f'{guide} has no block with the command {command!r}'
  assert _run_by(block['directive']), f'{guide}:{block["line"]}: say run-by= the test that runs it'
  missing = _missing(block['directive'])
  if missing:
    pytest.skip(f'{guide}:{block["line"]} needs {", ".join(missing)}')
  return _run_block(guide, block, directory, block['directive'] + list(extra))


def _missing(directive: list[str]) -> list[str]:
  """The modules a block `needs=` that do not import here."""
  return [t[6:] for t in directive if t.startswith('needs=') and not _importable(t[6:])]


def _run_by(directive: list[str]) -> str | None:
  return next((t.split('=', 1)[1] for t in directive if t.startswith('run-by=')), None)


@pytest.mark.parametrize('guide', GUIDES)
def test_every_documented_command_runs(guide, tmp_path):
  ran = 0
  for block in blocks(guide):
    if block['kind'] != 'sh':
      continue
    directive, where = block['directive'], f'{guide}:{block["line"]}'
    if directive[:1] == ['skip']:
      assert len(directive) > 1, f'{where}: a skipped block must say why'
      continue
    if _missing(directive):   # torch and transformers are test requirements of the pinned stack only
      continue
    test_file = _run_by(directive)
    if test_file:   # that test runs the block (run_documented) and checks what it writes
      with open(os.path.join(ROOT, test_file), encoding='utf-8') as f:
        assert f'run_documented({guide!r}' in f.read(), f'{where}: {test_file} does not run it'
      ran += 1
      continue
    _run_block(guide, block, tmp_path, directive)
    ran += 1
  assert ran, f'{guide} documents no command that runs'


def _config_keys() -> set[str]:
  from configs import default
  config = default.get_config('tiny')

  def walk(node, prefix):
    for key, value in node.items():
      yield prefix + key
      if isinstance(value, config_dict.ConfigDict):
        yield from walk(value, prefix + key + '.')
  return set(walk(config, ''))


def _anchors(path: str) -> set[str]:
  """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
  out = set()
  with open(path, encoding='utf-8') as f:
    fenced = False
    for line in f:
      fenced ^= line.startswith('```')
      if not fenced and line.startswith('#'):
        title = line.lstrip('#').strip().lower()
        out.add(re.sub(r'\s', '-', re.sub(r'[^\w\- ]', '', title)))
  return out


def test_what_the_guides_name_exists():
  keys, problems = _config_keys(), []
  for guide in GUIDES:
    text = '\n'.join(_read(guide))
    prose = re.sub(r'```.*?```', '', text, flags=re.S)
    for block in blocks(guide):
      if block['kind'] not in ('sh', 'text'):
        problems.append(f'{guide}:{block["line"]}: a block is ```sh (run) or ```text (not run)')
    for span in re.findall(r'`([^`\n]+)`', prose):
      if re.match(r'(python|pip|python3\S*) ', span) and not re.fullmatch(
          r'python (main\.py|-m [\w.]+)', span):
        problems.append(f'{guide}: `{span}`: a command with flags belongs in a ```sh block')
      placeholder = any(re.fullmatch(r'[A-Z_]+|<.*>', part) for part in span.split('/'))
      if re.fullmatch(r'[\w./-]+/[\w.-]+\.(py|json|md|txt)', span) and not placeholder:
        if not os.path.exists(os.path.join(ROOT, span)) and not os.path.exists(
            os.path.join(ROOT, 'configs', span)):
          problems.append(f'{guide}: `{span}` does not exist')
    for key in re.findall(r'--config\.([a-z_][\w]*(?:\.[a-z_]\w*)*)', text):
      if key not in keys:
        problems.append(f'{guide}: --config.{key} is not a config key')
    for target, anchor in re.findall(r'\]\(([^)#\s]*)(?:#([^)\s]+))?\)', text):
      if target.startswith(('http://', 'https://')):
        continue
      path = os.path.normpath(os.path.join(ROOT, os.path.dirname(guide), target or os.path.basename(guide)))
      if not os.path.exists(path):
        problems.append(f'{guide}: link to {target}, which does not exist')
      elif anchor and anchor not in _anchors(path):
        problems.append(f'{guide}: link to {target}#{anchor}: no such heading')
  assert not problems, '\n'.join(problems)


def test_readme_first_screen_holds_the_two_commands_and_the_guides():
  screen = '\n'.join(_read('README.md')[:SCREEN])
  assert 'pip install -r requirements.txt && python main.py --config=configs/fsdp.py' in screen
  assert 'pip install -r requirements-test.txt && python -m pytest -n 2 -q' in screen
  for guide in GUIDES[1:]:
    assert f'({guide})' in screen, f'{guide} is not in the first screen\'s table of guides'
