"""The workers' schedule under `-n N` (pytest.ini's `--dist=worksteal`): xdist's work stealing, with
each hand-over of tests moved to the edge of a test file where one lies within reach.

A file's `scope='module'` fixtures (a single-device reference run, two processes trained together:
tens of seconds each) are made once by every worker that runs a part of the file. xdist's first
split halves the collection by count and each steal takes half of a worker's queue, wherever the
halves fall: in the census of 2026-12-04 the first split fell inside tests/test_multihost.py, and
both workers made its two-process runs (37 s of the second one). Here a split goes to the file
edge nearest the one xdist chose, so a file is split only where its tests are all that is left
to hand over (a steal then still beats an idle worker)."""
from xdist.scheduler.worksteal import MIN_PENDING, WorkStealingScheduling


def _file(nodeid: str) -> str:
  return nodeid.split('::', 1)[0]


class FileEdgeStealing(WorkStealingScheduling):
  """WorkStealingScheduling whose hand-overs start at a test file's first test where they can."""

  def _edge_near(self, indices: list[int], want: int, low: int) -> int:
    """The position in `indices` (collection indices, in the order they are queued), from `low` to
    the last, nearest `want` where a file begins; `want` if none begins there."""
    files = [_file(self.collection[i]) for i in indices]
    edges = [k for k in range(max(low, 1), len(files)) if files[k] != files[k - 1]]
    return min(edges, key=lambda k: abs(k - want)) if edges else want

  def _send_tests(self, node, num: int) -> None:
    # Any share of the unassigned tests but the last (the first split among them) ends at a file's end.
    if 0 < num < len(self.pending):
      num = self._edge_near(self.pending, num, low=1)
    super()._send_tests(node, num)

  def add_node(self, node) -> None:
    super().add_node(node)
    send_steal = node.send_steal

    def steal_from_a_file_edge(indices):
      # `indices` is the tail of the node's queue; its head (the running test and the next) stays.
      pending = self.node2pending[node]
      split = self._edge_near(pending, len(pending) - len(indices), low=MIN_PENDING)
      send_steal(pending[split:])

    node.send_steal = steal_from_a_file_edge
