"""Tests for data/: tokenizer round trips, corpus listing and split, packed windows, sharding, resume."""
import json
import os

import numpy as np
import pytest

from data.tokenizer import ByteTokenizer
from data import (IGNORED, DataError, PreparedData, TokenBatches, Windows,
                  eval_batches, eval_window_indices, list_files, split_files)
from data.corpus import hash_fraction
from data.files import read_json, write_json
from data.prepare import prepare


def _take(batches, n):
  return [next(batches) for _ in range(n)]


def _assert_same_batches(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for key in x:
      np.testing.assert_array_equal(x[key], y[key])


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


@pytest.mark.parametrize("val_fraction", [0.0, -0.1, 0.51, 1.0, float("nan")])
def test_split_rejects_val_fraction_outside_open_zero_to_half(text_corpus, val_fraction):
  root, files = list_files(str(text_corpus / "**" / "*.txt"))
  with pytest.raises(DataError, match="val_fraction"):
    split_files(root, files, val_fraction)


def test_default_corpus_is_the_standard_library():
  root, files = list_files("")
  assert len(files) > 1000 and files == sorted(files)
  assert all(f.endswith(".py") and f.startswith(root) for f in files)
  assert not any("site-packages" in f or "dist-packages" in f for f in files)
  train, val = split_files(root, files, 0.01)
  assert len(train) + len(val) == len(files) and val


# --- preparation ----------------------------------------------------------------------------------

def _documents(prepared: PreparedData, split: str) -> list[bytes]:
  """Every document of the split, markers stripped, decoded back to bytes."""
  shards, out = prepared.split(split), []
  for i in range(len(shards)):
    tokens, starts = np.asarray(shards.shard_tokens(i)), np.asarray(shards.document_starts(i))
    for begin, end in zip(starts, list(starts[1:]) + [len(tokens)]):
      doc = tokens[begin:end]
      assert doc[0] == doc[-1] == 0   # bos and eos: the byte tokenizer's separator
      out.append(ByteTokenizer().decode_bytes(doc[1:-1]))
  return out


def _files(directory):
  return {p.name: p.read_bytes() for p in sorted(directory.iterdir())
          if p.name not in ("plan.json",)}


def test_prepared_shards_decode_back_to_the_input_bytes(text_corpus, tmp_path):
  pattern = str(text_corpus / "**" / "*.txt")
  index = prepare(pattern, "bytes", str(tmp_path / "one"), val_fraction=0.25, shard_mb=2e-4,
                  progress=False)
  prepared = PreparedData(str(tmp_path / "one"))
  root, files = list_files(pattern)
  train, val = split_files(root, files, 0.25)
  for split, docs in (("train", train), ("val", val)):
    assert _documents(prepared, split) == [open(d.path, "rb").read() for d in docs]
  # The byte tokenizer's ids are bytes: a byte a token on disk (uint16 before: twice the input).
  assert index["dtype"] == "uint8" and len(index["splits"]["train"]["shards"]) > 2
  for entry in index["splits"]["train"]["shards"]:
    assert os.path.getsize(tmp_path / "one" / f"{entry['name']}.bin") == entry["tokens"]
  assert index["splits"]["val"]["bytes"] == sum(os.path.getsize(d.path) for d in val)
  # Two worker processes write the same files.
  prepare(pattern, "bytes", str(tmp_path / "two"), val_fraction=0.25, shard_mb=2e-4, workers=2,
          progress=False)
  assert _files(tmp_path / "one") == _files(tmp_path / "two")


def test_a_single_file_is_cut_by_bytes(tmp_path):
  data = bytes(range(1, 256)) * 4
  (tmp_path / "one.txt").write_bytes(data)
  prepare(str(tmp_path / "one.txt"), "bytes", str(tmp_path / "out"), val_fraction=0.1,
          progress=False)
  prepared = PreparedData(str(tmp_path / "out"))
  train, val = _documents(prepared, "train"), _documents(prepared, "val")
  assert train[0] + val[0] == data and len(val[0]) == len(data) - int(len(data) * 0.9)


def test_preparation_resumes_keeps_finished_shards_and_is_idempotent(text_corpus, tmp_path):
  pattern, out = str(text_corpus / "**" / "*.txt"), tmp_path / "out"
  index = prepare(pattern, "bytes", str(out), val_fraction=0.25, shard_mb=2e-4, progress=False)
  finished = _files(out)
  stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
  # A kill after group 0 and in the middle of group 1: no index, group 1's record gone and one of
  # its shards half written (under its final name only if the rename had happened: here, a stale
  # temporary file and a damaged shard).
  (out / "index.json").unlink()
  (out / "group-00001.json").unlink()
  damaged = next(out.glob("*-00001.bin"))
  damaged.write_bytes(damaged.read_bytes()[:3])
  (out / "train-00002.bin.tmp999").write_bytes(b"half")
  assert prepare(pattern, "bytes", str(out), val_fraction=0.25, shard_mb=2e-4,
                 progress=False) == index
  now = _files(out)
  assert {k: v for k, v in now.items() if ".tmp" not in k} == finished
  kept = [p.name for p in out.iterdir() if p.name.startswith(("train-00000", "group-00000"))]
  assert kept and all(out.joinpath(n).stat().st_mtime_ns == stamps[n] for n in kept)
  # Finished: a re-run changes nothing.
  stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
  assert prepare(pattern, "bytes", str(out), val_fraction=0.25, shard_mb=2e-4,
                 progress=False) == index
  assert stamps == {p.name: p.stat().st_mtime_ns for p in out.iterdir()}


def _rewrite_same_length_and_time(path):
  """Other bytes of the same length, its modification time put back (a copy that keeps times)."""
  stat = os.stat(path)
  data = bytearray(path.read_bytes())
  data[0] ^= 0x01
  path.write_bytes(bytes(data))
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def _stamps(directory):
  return {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}


def _holds(prepared, data: bytes) -> bool:
  return any(data in _documents(prepared, split) for split in ("train", "val"))


def test_a_runs_cache_is_prepared_again_when_an_input_changes_content_only(text_corpus, tmp_path,
                                                                          capsys):
  from data.source import SourceKey, open_data
  pattern = str(text_corpus / "**" / "*.txt")
  cache = tmp_path / "cache"
  first = open_data(SourceKey(pattern, "bytes", 0.25), str(cache), progress=False)
  (directory,) = cache.iterdir()
  changed = text_corpus / "part1" / "doc01.txt"
  recorded = first.index["inputs"]
  assert recorded["files"]["part1/doc01.txt"] == changed.stat().st_size
  assert len(recorded["fingerprints"]) == len(recorded["files"]) == 41
  stamps = _stamps(directory)
  open_data(SourceKey(pattern, "bytes", 0.25), str(cache), progress=False)   # unchanged: kept
  assert _stamps(directory) == stamps
  assert "prepared from other inputs" not in capsys.readouterr().out
  _rewrite_same_length_and_time(changed)
  again = open_data(SourceKey(pattern, "bytes", 0.25), str(cache), progress=False)
  assert capsys.readouterr().out == (f"data        {directory} was prepared from other inputs "
                                     f"({changed} changed content, same size); preparing it again\n")
  # The new bytes are what the rebuilt shards hold.
  assert _holds(again, changed.read_bytes())
  changed.write_bytes(changed.read_bytes() + b"more")
  open_data(SourceKey(pattern, "bytes", 0.25), str(cache), progress=False)
  size = changed.stat().st_size
  assert f"({changed} changed size: {size - 4} bytes, now {size})" in capsys.readouterr().out


def test_preparing_again_over_inputs_whose_content_changed_is_refused(text_corpus, tmp_path):
  pattern = str(text_corpus / "**" / "*.txt")
  out = str(tmp_path / "prepared")
  prepare(pattern, "bytes", out, val_fraction=0.25, progress=False)
  before = _files(tmp_path / "prepared")
  changed = text_corpus / "part0" / "doc00.txt"
  _rewrite_same_length_and_time(changed)
  with pytest.raises(DataError, match=f"other inputs \\({changed} changed content, same size\\)"):
    prepare(pattern, "bytes", out, val_fraction=0.25, progress=False)
  assert _files(tmp_path / "prepared") == before


def test_a_prepared_directory_whose_input_changed_is_refused_naming_it(text_corpus, tmp_path):
  from data.source import SourceKey, open_data
  out = tmp_path / "prepared"
  prepare(str(text_corpus / "**" / "*.txt"), "bytes", str(out), val_fraction=0.25, progress=False)
  stamps = _stamps(out)
  open_data(SourceKey(str(out), "bytes", 0.25), str(tmp_path / "unused"))   # unchanged: opens
  changed = text_corpus / "part2" / "doc05.txt"
  _rewrite_same_length_and_time(changed)
  with pytest.raises(DataError) as info:
    open_data(SourceKey(str(out), "bytes", 0.25), str(tmp_path / "unused"))
  message = str(info.value)
  assert "\n" not in message and f"({changed} changed content, same size)" in message
  assert "run python -m data.prepare again" in message
  # Inputs that are not here (prepared on another machine, or moved) are not a change.
  text_corpus.rename(tmp_path / "elsewhere")
  open_data(SourceKey(str(out), "bytes", 0.25), str(tmp_path / "unused"))
  assert _stamps(out) == stamps and not (tmp_path / "unused").exists()


def test_preparations_from_before_fingerprints_open_and_resume_from_the_inputs_now(
    text_corpus, tmp_path, capsys):
  from data.source import SourceKey, cache_directory, open_data
  pattern = str(text_corpus / "**" / "*.txt")
  out = tmp_path / "prepared"
  prepare(pattern, "bytes", str(out), val_fraction=0.25, shard_mb=2e-4, progress=False)
  index, plan = read_json(out / "index.json"), read_json(out / "plan.json")
  del index["inputs"], plan["fingerprints"], plan["samples"]   # what an older version wrote
  write_json(out / "index.json", index)
  write_json(out / "plan.json", plan)
  changed = text_corpus / "part1" / "doc04.txt"
  _rewrite_same_length_and_time(changed)
  # Finished: opens unverified.
  assert not _holds(open_data(SourceKey(str(out), "bytes", 0.25), str(tmp_path / "unused")),
                    changed.read_bytes())
  # Unfinished: no group names its inputs, so every one is made again, from the inputs as they are.
  (out / "index.json").unlink()
  for group in out.glob("group-*.json"):
    write_json(group, {k: v for k, v in read_json(group).items() if k != "inputs"})
  prepare(pattern, "bytes", str(out), val_fraction=0.25, shard_mb=2e-4, progress=False)
  assert _holds(PreparedData(str(out)), changed.read_bytes())
  assert "fingerprints" in read_json(out / "plan.json")
  # A run's cache from then is prepared again.
  open_data(SourceKey(pattern, "bytes", 0.25), str(tmp_path / "cache"), progress=False)
  cached = os.path.join(cache_directory(str(tmp_path / "cache"), SourceKey(pattern, "bytes", 0.25)), "plan.json")
  write_json(cached, {k: v for k, v in read_json(cached).items()
                      if k not in ("fingerprints", "samples")})
  open_data(SourceKey(pattern, "bytes", 0.25), str(tmp_path / "cache"), progress=False)
  assert ("was prepared from other inputs (no fingerprints of its inputs: prepared by an older "
          "version); preparing it again") in capsys.readouterr().out


def test_bad_preparations_are_refused_in_one_line_writing_nothing(text_corpus, tmp_path):
  pattern = str(text_corpus / "**" / "*.txt")
  with pytest.raises(DataError, match="matches no files"):
    prepare(str(tmp_path / "none" / "*.txt"), "bytes", str(tmp_path / "a"), progress=False)
  assert not (tmp_path / "a").exists()
  (tmp_path / "mine").mkdir()
  (tmp_path / "mine" / "notes.txt").write_text("keep me")
  with pytest.raises(DataError, match="not empty and holds no preparation") as info:
    prepare(pattern, "bytes", str(tmp_path / "mine"), progress=False)
  assert "\n" not in str(info.value) and os.listdir(tmp_path / "mine") == ["notes.txt"]
  prepare(pattern, "bytes", str(tmp_path / "b"), val_fraction=0.25, progress=False)
  with pytest.raises(DataError, match="preparation of other inputs.*val_fraction"):
    prepare(pattern, "bytes", str(tmp_path / "b"), val_fraction=0.1, progress=False)
  (text_corpus / "part1" / "nul.txt").write_bytes(b"a\x00b")
  with pytest.raises(DataError, match="nul.txt byte 1: a NUL byte"):
    prepare(pattern, "bytes", str(tmp_path / "c"), progress=False)


def test_shards_are_checked_against_their_index_and_tokenizer(text_corpus, tmp_path):
  out = tmp_path / "out"
  prepare(str(text_corpus / "**" / "*.txt"), "bytes", str(out), val_fraction=0.25, progress=False)
  shard = out / "train-00000.bin"
  data = bytearray(shard.read_bytes())
  data[10] ^= 1
  shard.write_bytes(bytes(data))
  # Checked as it is opened: by its sampled fingerprint (a shard this small, whole), or its sha256.
  for verify, what in (("sampled", "sampled fingerprint"), ("full", "sha256")):
    shards = PreparedData(str(out), verify).split("train")
    with pytest.raises(DataError, match=f"does not match the {what}"):
      shards.shard_tokens(0)
  shard.write_bytes(bytes(data[:-2]))
  with pytest.raises(DataError, match="has .* bytes but its index says"):
    PreparedData(str(out)).split("train")

  class Other(ByteTokenizer):
    def identity(self):
      return {**super().identity(), "name": "tokenizer.json", "sha256": "ab" * 32}
  with pytest.raises(DataError, match="prepared with the tokenizer bytes"):
    PreparedData(str(out)).check_tokenizer(Other())
  with pytest.raises(DataError, match="without index.json"):
    PreparedData(str(tmp_path))


# --- windows and batches --------------------------------------------------------------------------

@pytest.fixture
def documents_dir(tmp_path):
  """Train documents of 20 bytes (22 tokens with their markers), two per shard, in eight shards of
  equal windows; and two validation documents."""
  corpus = tmp_path / "docs"
  corpus.mkdir()
  names = {"train": [], "val": []}
  for i in range(200):   # names whose path hash puts them on the side still short of documents
    name = f"d{i:03d}.txt"
    side = "val" if hash_fraction(name) < 0.25 else "train"
    if len(names[side]) < {"train": 16, "val": 2}[side]:
      names[side].append(name)
      (corpus / name).write_bytes(bytes([65 + i % 26]) * 20)
  out = tmp_path / "prepared"
  prepare(str(corpus / "*.txt"), "bytes", str(out), val_fraction=0.25, shard_mb=40 / 2**20,
          progress=False)
  return out


def _stream(shards, shard):
  return np.asarray(shards.shard_tokens(shard), np.int32)


def test_packed_windows_carry_segments_and_skip_targets_across_documents(documents_dir):
  shards = PreparedData(str(documents_dir)).split("train")
  windows = Windows(shards, seq_len=8, packing=True)
  assert windows.num_windows == sum((t - 1) // 8 for t in shards.tokens)
  batch = windows.gather(np.arange(windows.num_windows))
  assert set(batch) == {"inputs", "targets", "segments"}
  first = 0
  for shard in range(len(shards)):
    tokens, starts = _stream(shards, shard), np.asarray(shards.document_starts(shard))
    for k in range((len(tokens) - 1) // 8):
      row = first + k
      span = np.arange(k * 8, k * 8 + 9)
      np.testing.assert_array_equal(batch["inputs"][row], tokens[span[:-1]])
      doc = np.searchsorted(starts, span, side="right")
      np.testing.assert_array_equal(batch["segments"][row], doc[:-1] - doc[0] + 1)
      crosses = doc[1:] != doc[:-1]
      np.testing.assert_array_equal(batch["targets"][row],
                                    np.where(crosses, IGNORED, tokens[span[1:]]))
      # A crossing target is the next document's bos (the separator).
      assert (tokens[span[1:]][crosses] == 0).all()
    first += (len(tokens) - 1) // 8


def test_unpacked_windows_hold_one_document_each_padded(documents_dir):
  shards = PreparedData(str(documents_dir)).split("train")
  windows = Windows(shards, seq_len=8, packing=False)
  batch = windows.gather(np.arange(windows.num_windows))
  assert set(batch) == {"inputs", "targets"}
  rebuilt = []   # each document from its pieces: inputs, then the last target
  for inputs, targets in zip(batch["inputs"], batch["targets"]):
    n = int((targets != IGNORED).sum())
    assert (targets[n:] == IGNORED).all() and (inputs[n + 1:] == 0).all()
    np.testing.assert_array_equal(targets[:n - 1], inputs[1:n])
    piece = list(inputs[:n]) + [targets[n - 1]]
    if piece[0] == 0 and rebuilt and rebuilt[-1][-1] == 0 and len(rebuilt[-1]) > 1:
      rebuilt.append(piece)
    elif rebuilt and rebuilt[-1][-1] != 0:
      rebuilt[-1] += piece[1:]   # the next piece starts on the last token of this one
    else:
      rebuilt.append(piece)
  expected = [list(_stream(shards, s)[b:e]) for s in range(len(shards))
              for b, e in zip(shards.document_starts(s),
                              list(shards.document_starts(s)[1:]) + [int(shards.tokens[s])])]
  assert rebuilt == expected


def _batches(directory, steps, **kwargs):
  shards = PreparedData(str(directory)).split("train")
  batches = TokenBatches(Windows(shards, seq_len=4, packing=True), **kwargs)
  return [next(batches) for _ in range(steps)], shards


def test_a_uint16_preparation_of_byte_tokens_reads_to_the_same_batches(text_corpus, tmp_path,
                                                                       monkeypatch):
  """Byte tokens prepared as uint16 (what data.prepare wrote before uint8) read as they did: the
  same documents and the same int32 batches as the uint8 preparation, so a run trains alike."""
  from data import prepare as prepare_module
  pattern = str(text_corpus / "**" / "*.txt")
  prepare(pattern, "bytes", str(tmp_path / "narrow"), val_fraction=0.25, shard_mb=2e-4,
          progress=False)
  monkeypatch.setattr(prepare_module, "token_dtype", lambda vocab_size: np.dtype(np.uint16))
  wide = prepare(pattern, "bytes", str(tmp_path / "wide"), val_fraction=0.25, shard_mb=2e-4,
                 progress=False)
  assert wide["dtype"] == "uint16"
  for split in ("train", "val"):
    assert (_documents(PreparedData(str(tmp_path / "wide")), split)
            == _documents(PreparedData(str(tmp_path / "narrow")), split))
  narrow_batches, _ = _batches(tmp_path / "narrow", 6, global_batch_size=4, seed=2)
  wide_batches, _ = _batches(tmp_path / "wide", 6, global_batch_size=4, seed=2)
  _assert_same_batches(narrow_batches, wide_batches)


def test_the_same_step_gives_the_same_batch_on_one_or_two_processes(documents_dir):
  whole, _ = _batches(documents_dir, 12, global_batch_size=4, seed=1)
  shares = [_batches(documents_dir, 12, global_batch_size=4, seed=1, process_index=p,
                     process_count=2) for p in range(2)]
  for step, batch in enumerate(whole):
    for key in batch:
      np.testing.assert_array_equal(
          batch[key], np.concatenate([shares[0][0][step][key], shares[1][0][step][key]]))
  # Each process reads only its half of the windows: the shards of the first half of the corpus,
  # or of the second (eight shards of equal windows, so the halves meet on a shard boundary).
  opened = [set(shards.opened) for _, shards in shares]
  assert opened[0] and opened[1] and not opened[0] & opened[1]
  assert len(whole[0]["inputs"]) == 4 and whole[0]["inputs"].dtype == np.int32


def test_the_feed_reads_ahead_but_records_the_position_of_the_batches_taken(documents_dir):
  """train/feed.py: batches come in stream order while later ones are read ahead, and the state a
  checkpoint records resumes at the batch after the last one taken."""
  from train.feed import BatchFeed
  shards = PreparedData(str(documents_dir)).split("train")
  windows = Windows(shards, seq_len=4, packing=True)
  expected = _take(TokenBatches(windows, global_batch_size=2, seed=3), 7)
  stream = TokenBatches(windows, global_batch_size=2, seed=3)
  feed = BatchFeed(stream, lambda rows: rows, depth=3)
  taken = [feed.next() for _ in range(4)]
  import time
  deadline = time.time() + 30   # the reader thread may not have run yet on a loaded machine
  while stream.get_state()["step"] <= 4 and time.time() < deadline:
    time.sleep(0.01)
  state = feed.get_state()
  read_ahead = stream.get_state()["step"]
  feed.close()
  assert read_ahead > 4 and state["step"] == 4
  resumed = TokenBatches(windows, global_batch_size=2, seed=3)
  resumed.set_state(state)
  _assert_same_batches(taken + _take(resumed, 3), expected)


def test_resume_from_state_yields_the_same_next_batches(documents_dir):
  shards = PreparedData(str(documents_dir)).split("train")
  windows = Windows(shards, seq_len=4, packing=True)
  uninterrupted = TokenBatches(windows, global_batch_size=2, seed=3)
  expected = [next(uninterrupted) for _ in range(9)]
  first = TokenBatches(windows, global_batch_size=2, seed=3)
  [next(first) for _ in range(4)]
  state = json.loads(json.dumps(first.get_state()))
  resumed = TokenBatches(windows, global_batch_size=2, seed=3, process_index=1, process_count=2)
  resumed.set_state(state)
  _assert_same_batches([{k: v for k, v in b.items()} for b in [next(resumed) for _ in range(5)]],
                       [{k: v[1:] for k, v in b.items()} for b in expected[4:]])


@pytest.mark.parametrize("key,value", [("seed", 12), ("global_batch_size", 4), ("packing", False),
                                       ("num_windows", 5)])
def test_state_from_a_different_stream_is_rejected(documents_dir, key, value):
  shards = PreparedData(str(documents_dir)).split("train")
  batches = TokenBatches(Windows(shards, seq_len=4, packing=True), global_batch_size=2, seed=3)
  with pytest.raises(DataError, match=key):
    batches.set_state({**batches.get_state(), key: value})


def test_each_lane_sees_each_of_its_windows_once_per_epoch(documents_dir):
  shards = PreparedData(str(documents_dir)).split("train")
  windows = Windows(shards, seq_len=4, packing=True)
  total = windows.num_windows
  lane = total // 2   # two lanes (rows) of this many windows (total is even here)
  assert total == 2 * lane
  read = []
  gather = windows.gather
  windows.gather = lambda indices: read.append(list(indices)) or gather(indices)
  batches = TokenBatches(windows, global_batch_size=2, seed=0)
  [next(batches) for _ in range(2 * lane)]
  for r in range(2):
    seen = [indices[r] for indices in read]
    first, second = seen[:lane], seen[lane:]
    assert sorted(first) == sorted(second) == list(range(r * lane, (r + 1) * lane))
    assert first != second   # a fresh order per epoch


def test_small_splits_and_bad_shapes_are_refused(documents_dir):
  shards = PreparedData(str(documents_dir)).split("train")
  with pytest.raises(DataError, match="no window of train.seq_len=64"):
    Windows(shards, seq_len=64, packing=True)
  windows = Windows(shards, seq_len=4, packing=True)
  with pytest.raises(DataError, match="needs one per row"):
    TokenBatches(windows, global_batch_size=windows.num_windows + 1, seed=0)
  with pytest.raises(DataError, match="divisible by the number of processes"):
    TokenBatches(windows, global_batch_size=3, seed=0, process_index=0, process_count=2)


def test_eval_windows_spread_over_the_split_with_contiguous_rows(documents_dir):
  indices = eval_window_indices(100, batch_size=4, eval_tokens=6 * 4 * 8, seq_len=8)
  assert indices.shape == (6, 4) and len(set(indices.ravel())) == 24
  assert indices.min() == 0 and indices.max() > 90
  assert (np.diff(indices, axis=0) > 0).all() and (indices[:, 1:] > indices[:, :-1]).all()
  assert eval_window_indices(10, batch_size=4, eval_tokens=10**6, seq_len=8).shape == (2, 4)
  with pytest.raises(DataError, match="one evaluation batch needs batch_size=16"):
    eval_window_indices(10, batch_size=16, eval_tokens=100, seq_len=8)
  shards = PreparedData(str(documents_dir)).split("train")
  windows = Windows(shards, seq_len=4, packing=True)
  whole = eval_batches(windows, batch_size=4, eval_tokens=64)
  shares = [eval_batches(windows, batch_size=4, eval_tokens=64, process_index=p, process_count=2)
            for p in range(2)]
  for key in whole:
    assert whole[key].shape == (4, 4, 4)
    np.testing.assert_array_equal(whole[key], np.concatenate([s[key] for s in shares], axis=1))


# --- what a start reads of a large corpus -------------------------------------------------------

@pytest.fixture
def large_corpus(tmp_path):
  """Three text files of 8 MiB each: each far larger than a sampled fingerprint reads."""
  rng = np.random.default_rng(0)
  for i in range(3):
    letters = rng.integers(ord("a"), ord("z") + 1, 8 << 20, dtype=np.uint8)
    letters[::80] = ord("\n")
    (tmp_path / "big" / f"part{i}.txt").parent.mkdir(exist_ok=True)
    (tmp_path / "big" / f"part{i}.txt").write_bytes(letters.tobytes())
  return tmp_path / "big"


def _start(key, cache, verify):
  """What a run's start reads to check its data: open it, take a batch (this opens the shards)."""
  from data import files
  from data.source import open_data
  files.verified["bytes"] = 0
  prepared = open_data(key, str(cache), progress=False, verify=verify)
  next(TokenBatches(Windows(prepared.split("train"), seq_len=64, packing=True),
                    global_batch_size=2, seed=0))
  return files.verified["bytes"]


def test_a_start_reads_a_bounded_part_of_each_input_and_shard_unless_told_full(large_corpus,
                                                                              tmp_path):
  """data.verify_inputs: 'sampled' reads at most SAMPLE_BLOCKS x SAMPLE_BYTES of each input and of
  each shard file it opens, whatever their size (counted, not timed); 'full' reads them whole. A
  run's cache of a glob and a prepared directory alike."""
  from data.files import SAMPLE_BLOCKS, SAMPLE_BYTES
  from data.source import SourceKey
  inputs = sum(p.stat().st_size for p in large_corpus.iterdir())
  out = tmp_path / "prepared"
  index = prepare(str(large_corpus / "*.txt"), "bytes", str(out), val_fraction=0.4, progress=False)
  shard_files = 2 * sum(len(index["splits"][s]["shards"]) for s in ("train", "val"))
  bound = (3 + shard_files) * SAMPLE_BLOCKS * SAMPLE_BYTES
  for key in (SourceKey(str(out), "bytes", 0.4), SourceKey(str(large_corpus / "*.txt"), "bytes", 0.4)):
    _start(key, tmp_path / "cache", "sampled")   # (the glob: prepared into the cache)
    stamps = _stamps(tmp_path / "cache") if key.path.endswith(".txt") else None
    assert 0 < _start(key, tmp_path / "cache", "sampled") <= bound < inputs / 4
    assert _start(key, tmp_path / "cache", "full") >= inputs
    if stamps is not None:   # the cache was taken as it is, not prepared again
      assert _stamps(tmp_path / "cache") == stamps


def test_a_sampled_start_reads_a_spread_of_the_inputs_where_they_are_many(tmp_path):
  """Of 1,000 small inputs a sampled start reads SAMPLED_FILES (their sizes all); full reads all."""
  from data.files import SAMPLE_BLOCKS, SAMPLE_BYTES, SAMPLED_FILES
  from data.source import SourceKey
  (tmp_path / "many").mkdir()
  for i in range(1000):
    (tmp_path / "many" / f"{i:04d}.txt").write_bytes(b"%04d " % i * 800)   # 4,000 bytes
  out = tmp_path / "prepared"
  index = prepare(str(tmp_path / "many" / "*.txt"), "bytes", str(out), val_fraction=0.2,
                  progress=False)
  shard_files = 2 * sum(len(index["splits"][s]["shards"]) for s in ("train", "val"))
  key = SourceKey(str(out), "bytes", 0.2)
  assert _start(key, tmp_path, "sampled") <= (SAMPLED_FILES * 4000
                                               + shard_files * SAMPLE_BLOCKS * SAMPLE_BYTES)
  assert _start(key, tmp_path, "full") >= 1000 * 4000


def test_what_a_sampled_start_sees_and_what_only_a_full_one_does(large_corpus, tmp_path):
  """A change inside a sampled block (the first bytes) is refused by a sampled start; one of the
  same size between the blocks passes it, and a full start refuses it (docs/data.md says so)."""
  from data.files import SAMPLE_BYTES
  from data.source import SourceKey, open_data
  out = tmp_path / "prepared"
  prepare(str(large_corpus / "*.txt"), "bytes", str(out), val_fraction=0.4, progress=False)
  key, changed = SourceKey(str(out), "bytes", 0.4), large_corpus / "part1.txt"
  _rewrite_same_length_and_time(changed)   # its first byte
  with pytest.raises(DataError, match="changed content, same size"):
    open_data(key, str(tmp_path / "unused"), verify="sampled")
  _rewrite_same_length_and_time(changed)   # back as it was
  data = bytearray(changed.read_bytes())
  data[SAMPLE_BYTES + 10] ^= 1   # after the first block, before the second
  changed.write_bytes(bytes(data))
  open_data(key, str(tmp_path / "unused"), verify="sampled")
  with pytest.raises(DataError, match="changed content, same size"):
    open_data(key, str(tmp_path / "unused"), verify="full")


def test_an_unknown_verify_mode_is_refused_in_one_line():
  from data.source import check_data
  from tests.helpers import tiny_config
  config = tiny_config(**{'data.verify_inputs': 'fast'})
  with pytest.raises(DataError, match=r"^data.verify_inputs='fast'; allowed: sampled, full$"):
    check_data(config.data)


def test_an_older_versions_byte_preparation_is_kept_and_gains_its_sampled_fingerprints(
    text_corpus, tmp_path, monkeypatch):
  """What the version before uint8 shards and sampled fingerprints wrote (uint16, no `samples`):
  data.prepare again over it checks its inputs whole, keeps its shards and type, and records the
  sampled fingerprints a start needs; unfinished, it resumes in its own type."""
  from data import prepare as prepare_module
  from data.prepare import prepared_already
  from data.source import SourceKey, open_data
  pattern, out = str(text_corpus / "**" / "*.txt"), tmp_path / "old"
  with monkeypatch.context() as patched:
    patched.setattr(prepare_module, "token_dtype", lambda vocab_size: np.dtype(np.uint16))
    prepare(pattern, "bytes", str(out), val_fraction=0.25, shard_mb=2e-4, progress=False)
  plan, index = read_json(out / "plan.json"), read_json(out / "index.json")
  del plan["samples"], index["inputs"]["samples"]
  for split in ("train", "val"):
    for entry in index["splits"][split]["shards"]:
      del entry["sample"], entry["docs_sample"]
  write_json(out / "plan.json", plan)
  write_json(out / "index.json", index)
  shards = {p.name: p.read_bytes() for p in out.glob("*.bin")}
  again = prepare(pattern, "bytes", str(out), val_fraction=0.25, shard_mb=2e-4, progress=False)
  assert again["dtype"] == read_json(out / "plan.json")["dtype"] == "uint16"
  assert again["inputs"]["samples"] == read_json(out / "plan.json")["samples"]
  assert all("sample" in e for s in ("train", "val") for e in again["splits"][s]["shards"])
  assert {p.name: p.read_bytes() for p in out.glob("*.bin")} == shards
  open_data(SourceKey(str(out), "bytes", 0.25), str(tmp_path / "unused"))   # checks, sampled
  # Once given its samples it stays as it is, in its type: again, and as a run's cache would be.
  assert prepare(pattern, "bytes", str(out), val_fraction=0.25, shard_mb=2e-4,
                 progress=False) == again
  assert prepared_already(pattern, "bytes", str(out), val_fraction=0.25, shard_mb=2e-4)
  # Unfinished (no index, a group's record gone): finished in its own type, to the same documents.
  write_json(out / "plan.json", plan)
  (out / "index.json").unlink()
  (out / "group-00001.json").unlink()
  resumed = prepare(pattern, "bytes", str(out), val_fraction=0.25, shard_mb=2e-4, progress=False)
  assert resumed["dtype"] == "uint16"
  narrow = prepare(pattern, "bytes", str(tmp_path / "new"), val_fraction=0.25, shard_mb=2e-4,
                   progress=False)
  for split in ("train", "val"):
    assert _documents(PreparedData(str(out)), split) == _documents(
        PreparedData(str(tmp_path / "new")), split)
  assert narrow["dtype"] == "uint8"
