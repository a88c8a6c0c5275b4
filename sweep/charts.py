"""The PNG charts a sweep file declares, drawn from its result rows (matplotlib, no display).

A chart is a dict:
  file, title        the PNG's name (in the sweep's directory) and its heading
  x, y               a label or metric on each axis (y: a numeric metric)
  series             optional: a label; one line (or marker) per value
  panels             optional: a label; one subplot per value
  kind               'line' (default) or 'scatter'
  logx, logy         log-scale axes (default False)
  hline, hline_label optional: a horizontal line (e.g. a device's memory) and its legend text
  yerr               optional: a metric holding each point's own error bar (e.g. final_loss_sem)
  xlabel, ylabel     axis titles (default: the metric's header or the label's name)
  dodge              optional: spread the series that share an x apart by this fraction of the
                     x range (numeric x), so markers at one x stay readable; the title says so
  where              optional: {label: [values]}: only the points whose labels take those values
Points that share panel, series and x (seeds, say) are drawn as their mean with an error bar of
the standard error over them (sd / sqrt(n)); a single point gets its `yerr`, if any.
"""
import math
import os
import textwrap

CHART_KEYS = ('file', 'title', 'x', 'y', 'series', 'panels', 'kind', 'logx', 'logy', 'hline',
              'hline_label', 'yerr', 'xlabel', 'ylabel', 'dodge', 'where')


def check_chart(chart: dict, labels: list[str], metrics: tuple[str, ...]) -> None:
  from sweep.grid import SweepError
  name = chart.get('file', '?')
  unknown = sorted(set(chart) - set(CHART_KEYS))
  if unknown:
    raise SweepError(f'chart {name}: unknown key {unknown[0]!r}; allowed: {", ".join(CHART_KEYS)}')
  for key in ('file', 'title', 'x', 'y'):
    if key not in chart:
      raise SweepError(f'chart {name}: missing key {key!r}')
  if not str(chart['file']).endswith('.png') or os.sep in chart['file']:
    raise SweepError(f'chart file={chart["file"]!r}; a file name ending in .png')
  columns = [*labels, *metrics]
  for key in ('x', 'y', 'yerr'):
    if key in chart and chart[key] not in columns:
      raise SweepError(f'chart {name}: {key}={chart[key]!r} is not a label or metric of the sweep; '
                       f'known: {", ".join(columns)}')
  for key in ('series', 'panels'):
    if key in chart and chart[key] not in labels:
      raise SweepError(f'chart {name}: {key}={chart[key]!r} is not a label of the sweep; '
                       f'labels: {", ".join(labels)}')
  where = chart.get('where', {})
  if not isinstance(where, dict) or not all(isinstance(v, (list, tuple)) for v in where.values()):
    raise SweepError(f'chart {name}: where={where!r}; a dict of label -> list of values')
  for key in where:
    if key not in labels:
      raise SweepError(f'chart {name}: where names {key!r}, not a label of the sweep; labels: '
                       f'{", ".join(labels)}')
  if chart.get('kind', 'line') not in ('line', 'scatter'):
    raise SweepError(f'chart {name}: kind={chart["kind"]!r}; allowed: line, scatter')


def _title(column: str) -> str:
  from sweep.metrics import METRICS
  return METRICS[column].header if column in METRICS else column


def _groups(rows: list[dict], chart: dict) -> dict:
  """panel -> series -> [(x, mean y, error or None, n)], x in first-seen order."""
  out = {}
  where = chart.get('where', {})
  for row in rows:
    if any(row.get(label) not in values for label, values in where.items()):
      continue
    x, y = row.get(chart['x']), row.get(chart['y'])
    if x is None or not isinstance(y, (int, float)):
      continue
    panel = row.get(chart['panels']) if 'panels' in chart else None
    series = row.get(chart['series']) if 'series' in chart else None
    out.setdefault(panel, {}).setdefault(series, {}).setdefault(x, []).append(
        (y, row.get(chart['yerr']) if 'yerr' in chart else None))
  result = {}
  for panel, by_series in out.items():
    result[panel] = {}
    for series, by_x in by_series.items():
      points = []
      for x, values in by_x.items():
        ys = [v for v, _ in values]
        mean = sum(ys) / len(ys)
        if len(ys) > 1:
          sd = math.sqrt(sum((v - mean) ** 2 for v in ys) / (len(ys) - 1))
          error = sd / math.sqrt(len(ys))
        else:
          error = values[0][1]
        points.append((x, mean, error, len(ys)))
      result[panel][series] = points
  return result


def draw(chart: dict, rows: list[dict], directory: str) -> str | None:
  """Writes the chart's PNG into `directory`; None when no point has a value to draw."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  groups = _groups(rows, chart)
  if not groups:
    return None
  panels = list(groups)
  columns = min(len(panels), 3)
  lines = math.ceil(len(panels) / columns)
  # A legend goes in an empty panel slot, or outside the panels on the right (never over points).
  outside = ('series' in chart or 'hline_label' in chart) and len(panels) == lines * columns
  fig, axes = plt.subplots(lines, columns, figsize=(5.2 * columns + 2.4 * outside, 4.2 * lines),
                           squeeze=False)
  categorical = any(isinstance(x, str) for p in groups.values() for s in p.values()
                    for x, *_ in s)
  pooled = any(n > 1 for p in groups.values() for s in p.values() for *_, n in s)
  # One colour per series in every panel (first seen, first colour), so one legend reads them all.
  colours = {}
  for by_series in groups.values():
    for series in by_series:
      colours.setdefault(series, f'C{len(colours) % 10}')
  for ax, panel in zip(axes.flat, panels):
    all_x = [x for s in groups[panel].values() for x, *_ in s]
    spread = (chart.get('dodge', 0) * ((max(all_x) - min(all_x)) or 1.0)
              if not categorical and all_x else 0.0)
    sharing = {}   # x -> the series that have a point there, in order: only those are spread
    for series, points in groups[panel].items():
      for x, *_ in points:
        sharing.setdefault(x, []).append(series)
    for series, points in groups[panel].items():
      xs = [x for x, *_ in points]
      positions = ([x + spread * (sharing[x].index(series) - (len(sharing[x]) - 1) / 2)
                    for x in xs] if not categorical else [str(x) for x in xs])
      ys = [y for _, y, _, _ in points]
      errors = [e if e is not None else 0.0 for _, _, e, _ in points]
      style = dict(marker='o', capsize=3, label=None if series is None else str(series),
                   color=colours[series])
      if chart.get('kind', 'line') == 'scatter':
        style['linestyle'] = 'none'
      if any(errors):
        ax.errorbar(positions, ys, yerr=errors, **style)
      else:
        ax.plot(positions, ys, **{k: v for k, v in style.items() if k != 'capsize'})
    if 'hline' in chart:
      ax.axhline(chart['hline'], color='red', linestyle='--', linewidth=1,
                 label=chart.get('hline_label'))
    if chart.get('logx') and not categorical:
      ax.set_xscale('log')
    if chart.get('logy'):
      ax.set_yscale('log')
    if chart.get('logx') and not categorical:   # the grid's own values as ticks, not decades
      ticks = sorted({x for s in groups[panel].values() for x, *_ in s})
      ax.set_xticks(ticks, [f'{x:.3g}' for x in ticks])
      ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    if panel is not None:
      ax.set_title(f'{chart["panels"]} = {panel}', fontsize=10)
    ax.set_xlabel(chart.get('xlabel', _title(chart['x'])))
    ax.set_ylabel(chart.get('ylabel', _title(chart['y'])))
    ax.grid(True, alpha=0.3)
    if categorical:
      plt.setp(ax.get_xticklabels(), rotation=30, ha='right')
  spare = list(axes.flat)[len(panels):]
  for ax in spare:
    ax.set_visible(False)
  handles, names = axes.flat[0].get_legend_handles_labels()
  if handles and spare:   # one legend for every panel, in the first empty slot
    spare[0].set_visible(True)
    spare[0].axis('off')
    spare[0].legend(handles, names, loc='center', title=chart.get('series'))
  elif handles:
    axes.flat[columns - 1].legend(handles, names, loc='upper left', bbox_to_anchor=(1.02, 1),
                                  fontsize=8, title=chart.get('series'))
  title = chart['title'] + ('\n(mean of repeated points, error bars ± one standard error over '
                            'them)' if pooled else '') + (
                                '\n(series at one x drawn side by side)' if chart.get('dodge') else '')
  width = int((5.2 * columns + 2.4 * outside) * 13)   # characters of 11-point text across
  fig.suptitle('\n'.join(textwrap.fill(line, width) for line in title.split('\n')), fontsize=11)
  fig.tight_layout()
  path = os.path.join(directory, chart['file'])
  temporary = path + '.tmp.png'
  fig.savefig(temporary, dpi=110)
  plt.close(fig)
  os.replace(temporary, path)
  return path
