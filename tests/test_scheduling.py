"""tests/scheduling.py: the workers' first split and their steals start at a test file's first test
where one is within reach; where none is, a steal is xdist's own (half the queue's tail); and no
steal asks for a worker's running test or the next one, which it has taken already."""
from tests.scheduling import FileEdgeStealing


class Config:
  def getvalue(self, name):
    return {'tx': ['2*popen']}[name]


class Worker:
  """A worker as the scheduler sees it: what it was sent and what it was asked to give back."""

  def __init__(self, name):
    self.gateway = type('Gateway', (), {'id': name})()
    self.sent, self.steals, self.shutting_down = [], [], False

  def send_runtest_some(self, indices):
    self.sent.extend(indices)

  def send_steal(self, indices):
    self.steals.append(list(indices))

  def shutdown(self):
    self.shutting_down = True


def started(collection):
  schedule, workers = FileEdgeStealing(Config()), (Worker('gw0'), Worker('gw1'))
  for worker in workers:
    schedule.add_node(worker)
  for worker in workers:
    schedule.add_node_collection(worker, collection)
  schedule.schedule()
  return schedule, workers


def test_the_first_split_and_a_steal_fall_where_a_file_begins():
  collection = ([f'tests/test_a.py::t{i}' for i in range(3)] + [f'tests/test_b.py::t{i}' for i in range(5)]
                + [f'tests/test_c.py::t{i}' for i in range(4)])
  schedule, (first, second) = started(collection)
  # xdist's own split is 6 + 6, inside test_b; the nearest edge is test_c's start.
  assert first.sent == list(range(8)) and second.sent == [8, 9, 10, 11]
  for index in (8, 9, 10):   # the second worker is down to its last test: it steals
    schedule.mark_test_complete(second, index)
  # xdist would ask for the queue's last 4 (inside test_b); test_b begins at the queue's fourth
  # place, which leaves the first worker its running test and the next.
  assert first.steals == [[3, 4, 5, 6, 7]]
  schedule.remove_pending_tests_from_node(first, [3, 4, 5, 6, 7])
  assert second.sent[4:] == [3, 4, 5, 6, 7]


def test_a_queue_of_one_file_is_split_where_xdist_splits_it():
  schedule, (first, second) = started([f'tests/test_a.py::t{i}' for i in range(12)])
  assert first.sent == list(range(6)) and second.sent == list(range(6, 12))
  for index in range(6, 11):
    schedule.mark_test_complete(second, index)
  assert first.steals == [[3, 4, 5]]


def test_a_file_beginning_at_the_next_test_is_not_where_a_steal_starts():
  collection = (['tests/test_a.py::t0'] + [f'tests/test_b.py::t{i}' for i in range(7)]
                + [f'tests/test_c.py::t{i}' for i in range(4)])
  schedule, (first, second) = started(collection)
  assert first.sent == list(range(8))
  for index in (8, 9, 10):
    schedule.mark_test_complete(second, index)
  # The only edge in the first worker's queue is at its next test (test_b's first): xdist's half.
  assert first.steals == [[4, 5, 6, 7]]
