"""Tests for data/: tokenizer round trips, corpus listing and split, packed windows, sharding, resume."""
import json
import os

import numpy as np
import pytest

from data import (ByteTokenizer, DataError, Shard, TokenBatches, eval_batches, list_files,
                  load_tokens, split_files)


def _take(batches, n):
  return [next(batches) for _ in range(n)]


def _assert_same_batches(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x["inputs"], y["inputs"])
    np.testing.assert_array_equal(x["targets"], y["targets"])


def _window_ids(batch, seq_len):
  # With tokens = arange(n), a window's first input token identifies it.
  return (batch["inputs"][:, 0] // seq_len).tolist()


@pytest.fixture
def text_corpus(tmp_path):
  """40 small files in nested folders, one of them not valid UTF-8."""
  for i in range(40):
    path = tmp_path / "corpus" / f"part{i % 3}" / f"doc{i:02d}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(f"document {i}\n".encode() * (i + 1))
  (tmp_path / "corpus" / "part0" / "latin1.txt").write_bytes(b"caf\xe9 \xff\xfe\x80")
  (tmp_path / "corpus" / "notes.md").write_text("not matched by *.txt")
  return tmp_path / "corpus"


# --- tokenizer ------------------------------------------------------------------------------------

def test_byte_tokenizer_round_trips_arbitrary_bytes():
  tok = ByteTokenizer()
  rng = np.random.default_rng(0)
  for data in [bytes(range(256)), rng.integers(0, 256, 10_000, dtype=np.uint8).tobytes(),
               b"\xff\xfe\xc3\x28\xa0\xa1\xe2\x28\xa1\x80", b""]:
    ids = tok.encode(data)
    assert ids.dtype == np.uint8 and len(ids) == len(data)
    assert tok.decode_bytes(ids) == data
  assert tok.vocab_size == 256


def test_byte_tokenizer_round_trips_unicode_and_replaces_invalid_utf8():
  tok = ByteTokenizer()
  text = "héllo, wörld: 日本語 🚀 \x00 tab\t"
  ids = tok.encode(text)
  np.testing.assert_array_equal(ids, np.frombuffer(text.encode("utf-8"), np.uint8))
  assert tok.decode(ids) == text
  assert tok.decode(ids.astype(np.int32).tolist()) == text
  assert tok.decode(tok.encode(b"ok \xff")) == "ok \ufffd"
  with pytest.raises(ValueError, match="300"):
    tok.decode_bytes([65, 300])


# --- corpus ---------------------------------------------------------------------------------------

def test_glob_lists_sorted_regular_files_under_their_common_root(text_corpus):
  root, files = list_files(str(text_corpus / "**" / "*.txt"))
  assert root == str(text_corpus)
  assert len(files) == 41 and files == sorted(files)
  assert all(os.path.isabs(f) and f.endswith(".txt") for f in files)


def test_glob_expands_home(text_corpus, monkeypatch):
  monkeypatch.setenv("HOME", str(text_corpus.parent))
  _, files = list_files("~/corpus/part1/*.txt")
  assert len(files) == 13 and all(f.startswith(str(text_corpus / "part1")) for f in files)


def test_glob_that_matches_nothing_names_the_glob(tmp_path):
  pattern = str(tmp_path / "nothing" / "**" / "*.txt")
  with pytest.raises(DataError, match="matches no files") as info:
    list_files(pattern)
  assert repr(pattern) in str(info.value) and "\n" not in str(info.value)


def test_split_is_deterministic_disjoint_and_covers_all_files(text_corpus):
  root, files = list_files(str(text_corpus / "**" / "*.txt"))
  train, val = split_files(root, files, 0.25)
  assert (train, val) == split_files(root, list(reversed(files)), 0.25)
  train_paths, val_paths = {s.path for s in train}, {s.path for s in val}
  assert train_paths and val_paths and not train_paths & val_paths
  assert train_paths | val_paths == set(files)
  assert all((s.start_fraction, s.end_fraction) == (0.0, 1.0) for s in train + val)


def test_split_depends_on_relative_path_only(text_corpus, tmp_path):
  root, files = list_files(str(text_corpus / "**" / "*.txt"))
  moved = tmp_path / "elsewhere"
  os.rename(text_corpus, moved)
  moved_root, moved_files = list_files(str(moved / "**" / "*.txt"))
  rel = lambda shards, r: sorted(os.path.relpath(s.path, r) for s in shards)
  val, moved_val = split_files(root, files, 0.25)[1], split_files(moved_root, moved_files, 0.25)[1]
  assert rel(val, root) == rel(moved_val, moved_root)


def test_single_file_splits_by_bytes(tmp_path):
  path = tmp_path / "one.txt"
  data = bytes(range(256)) * 4
  path.write_bytes(data)
  root, files = list_files(str(path))
  train, val = split_files(root, files, 0.1)
  assert train == [Shard(str(path), 0.0, 0.9)] and val == [Shard(str(path), 0.9, 1.0)]
  train_tokens, val_tokens = load_tokens(train, ByteTokenizer()), load_tokens(val, ByteTokenizer())
  assert train_tokens[:-1].tobytes() + val_tokens[:-1].tobytes() == data
  assert len(val_tokens) - 1 == len(data) - int(len(data) * 0.9)


@pytest.mark.parametrize("val_fraction", [0.0, -0.1, 0.51, 1.0, float("nan")])
def test_split_rejects_val_fraction_outside_open_zero_to_half(text_corpus, val_fraction):
  root, files = list_files(str(text_corpus / "**" / "*.txt"))
  with pytest.raises(DataError, match="val_fraction"):
    split_files(root, files, val_fraction)


def test_load_tokens_concatenates_raw_bytes_in_sorted_order_with_newlines(tmp_path):
  (tmp_path / "b.txt").write_bytes(b"second")
  (tmp_path / "a.txt").write_bytes(b"caf\xe9")
  files = [str(tmp_path / "b.txt"), str(tmp_path / "a.txt")]
  tokens = load_tokens(files, ByteTokenizer())
  assert tokens.dtype == np.uint8 and tokens.tobytes() == b"caf\xe9\nsecond\n"


def test_default_corpus_is_the_standard_library():
  root, files = list_files("")
  assert len(files) > 1000 and files == sorted(files)
  assert all(f.endswith(".py") and f.startswith(root) for f in files)
  assert not any("site-packages" in f or "dist-packages" in f for f in files)
  train, val = split_files(root, files, 0.01)
  assert len(train) + len(val) == len(files) and val
  # The validation side is small (~1% of 31 MB): load it and run it through eval end to end.
  batches = eval_batches(load_tokens(val, ByteTokenizer()), seq_len=128, batch_size=8,
                         num_batches=2)
  assert len(batches) == 2 and batches[0]["inputs"].shape == (8, 128)


# --- training batches -----------------------------------------------------------------------------

def test_windows_are_shifted_by_one_and_match_the_corpus():
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, 256, 1000, dtype=np.uint8)
  seq_len = 16
  batches = TokenBatches(tokens, seq_len=seq_len, global_batch_size=4, seed=0, shuffle=False)
  assert batches.num_windows == (1000 - 1) // seq_len and batches.tokens_per_batch == 64
  for step, batch in enumerate(_take(batches, 3)):
    assert batch["inputs"].dtype == np.int32 and batch["inputs"].shape == (4, seq_len)
    for row in range(4):
      start = (step * 4 + row) * seq_len
      np.testing.assert_array_equal(batch["inputs"][row], tokens[start:start + seq_len])
      np.testing.assert_array_equal(batch["targets"][row], tokens[start + 1:start + seq_len + 1])


def test_shuffled_windows_are_corpus_windows():
  tokens = np.arange(401, dtype=np.int32)
  batch = next(TokenBatches(tokens, seq_len=8, global_batch_size=6, seed=3))
  for inputs, targets in zip(batch["inputs"], batch["targets"]):
    assert inputs[0] % 8 == 0
    np.testing.assert_array_equal(inputs, tokens[inputs[0]:inputs[0] + 8])
    np.testing.assert_array_equal(targets, inputs + 1)


def test_process_shares_concatenate_to_the_global_batch():
  tokens = np.arange(5000, dtype=np.int32)
  kwargs = dict(seq_len=10, global_batch_size=8, seed=7)
  whole = _take(TokenBatches(tokens, **kwargs), 6)
  shares = [_take(TokenBatches(tokens, **kwargs, process_index=p, process_count=2), 6)
            for p in range(2)]
  for step in range(6):
    for key in ("inputs", "targets"):
      assert shares[0][step][key].shape == (4, 10)
      np.testing.assert_array_equal(
          np.concatenate([shares[0][step][key], shares[1][step][key]]), whole[step][key])


def test_resume_from_state_yields_the_same_next_batches():
  tokens = np.random.default_rng(2).integers(0, 256, 3000, dtype=np.uint8)
  kwargs = dict(seq_len=12, global_batch_size=4, seed=11)
  batches = TokenBatches(tokens, **kwargs)
  _take(batches, 5)
  state = json.loads(json.dumps(batches.get_state()))
  uninterrupted = _take(batches, 3)
  resumed = TokenBatches(tokens, **kwargs)
  resumed.set_state(state)
  _assert_same_batches(_take(resumed, 3), uninterrupted)


def test_resume_works_on_a_different_process_count():
  tokens = np.arange(3000, dtype=np.int32)
  kwargs = dict(seq_len=12, global_batch_size=4, seed=11)
  batches = TokenBatches(tokens, **kwargs)
  _take(batches, 5)
  state, uninterrupted = batches.get_state(), next(batches)
  share = TokenBatches(tokens, **kwargs, process_index=1, process_count=2)
  share.set_state(state)
  np.testing.assert_array_equal(next(share)["inputs"], uninterrupted["inputs"][2:])


@pytest.mark.parametrize("key,value", [("seed", 12), ("seq_len", 6), ("global_batch_size", 8),
                                       ("num_tokens", 2999), ("step", -1)])
def test_state_from_a_different_stream_is_rejected(key, value):
  tokens = np.arange(3000, dtype=np.int32)
  batches = TokenBatches(tokens, seq_len=12, global_batch_size=4, seed=11)
  state = {**batches.get_state(), key: value}
  with pytest.raises(DataError, match=key):
    batches.set_state(state)


@pytest.mark.parametrize("num_windows", [12, 10])
def test_each_epoch_sees_every_window_once_in_a_new_order(num_windows):
  seq_len, batch_size = 5, 4
  tokens = np.arange(num_windows * seq_len + 1, dtype=np.int32)
  batches = TokenBatches(tokens, seq_len=seq_len, global_batch_size=batch_size, seed=0)
  assert batches.num_windows == num_windows
  # Batches may straddle epochs (10 windows, 4 per batch); the window stream itself is per epoch.
  stream = sum((_window_ids(b, seq_len) for b in _take(batches, 3 * num_windows // batch_size + 1)),
               [])
  epochs = [stream[e * num_windows:(e + 1) * num_windows] for e in range(3)]
  for epoch in epochs:
    assert sorted(epoch) == list(range(num_windows))
  assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
  assert epochs[0] != list(range(num_windows))


def test_seed_picks_the_order():
  tokens = np.arange(2001, dtype=np.int32)
  order = lambda seed: _window_ids(next(TokenBatches(tokens, seq_len=4, global_batch_size=16,
                                                     seed=seed)), 4)
  assert order(5) == order(5) and order(5) != order(6)


def test_batch_not_divisible_by_process_count_is_rejected():
  with pytest.raises(DataError, match="global_batch_size=6 must be divisible"):
    TokenBatches(np.arange(1000), seq_len=8, global_batch_size=6, seed=0, process_count=4)


def test_corpus_shorter_than_one_sequence_is_rejected():
  with pytest.raises(DataError, match="has 10 tokens.*needs 17"):
    TokenBatches(np.arange(10), seq_len=16, global_batch_size=1, seed=0)


# --- evaluation batches ---------------------------------------------------------------------------

def test_eval_batches_are_the_first_windows_in_order_split_by_process():
  tokens = np.arange(1001, dtype=np.int32)
  whole = eval_batches(tokens, seq_len=10, batch_size=4, num_batches=3)
  assert [_window_ids(b, 10) for b in whole] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
  shares = [eval_batches(tokens, seq_len=10, batch_size=4, num_batches=3, process_index=p,
                         process_count=2) for p in range(2)]
  for step in range(3):
    np.testing.assert_array_equal(
        np.concatenate([shares[0][step]["targets"], shares[1][step]["targets"]]),
        whole[step]["targets"])


def test_eval_batches_shrink_to_the_corpus_and_reject_less_than_one_batch():
  tokens = np.arange(101, dtype=np.int32)  # 10 windows of 10
  assert len(eval_batches(tokens, seq_len=10, batch_size=4, num_batches=50)) == 2
  with pytest.raises(DataError, match="batch_size=16"):
    eval_batches(tokens, seq_len=10, batch_size=16, num_batches=1)


def test_a_batch_of_one_sequence_streams_every_window_per_epoch():
  # A batch of one is the natural setting for a large model on one device (grain's endless repeat
  # once overflowed there).
  seq_len, num_windows = 5, 7
  tokens = np.arange(num_windows * seq_len + 1)
  batches = TokenBatches(tokens, seq_len=seq_len, global_batch_size=1, seed=0)
  first_epoch = sum((_window_ids(b, seq_len) for b in _take(batches, num_windows)), [])
  assert sorted(first_epoch) == list(range(num_windows))
