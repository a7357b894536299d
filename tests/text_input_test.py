"""params/text_input.py: byte windows of text files, against the files' bytes.

The reference stream is built here from the files' contents (EOD, then each
file's bytes, the training files in sorted order), and the windows the
generator reads, the batches its graph makes, the epochs' orders and the
held-out split are checked against it.
"""

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe.lingvo_support import flags_and_seeds
from lingvo.core import py_utils
from params import text_input

flags_and_seeds.EnsureFlagsParsed()

EOD = 256
_FILES = {
    'a/one.py': b'def f():\n  return 1\n',
    'a/two.py': b'x = [i * i for i in range(10)]\nprint(x)\n',
    'b/three.py': b'class C:\n  pass\n' * 3,
    'held/four.py': b'\xc3\xa9t\xc3\xa9 held out only ' * 2,
    'held/five.py': b'# another held-out file, never trained on\n',
}


@pytest.fixture(name='root')
def fixture_root(tmp_path):
  for name, data in _FILES.items():
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
  (tmp_path / 'notes.txt').write_bytes(b'not matched by *.py')
  return tmp_path


def _Params(root, **kwargs):
  return text_input.TextInput.Params().Set(
      file_pattern=str(root / '**' / '*.py'), held_out_patterns=['held/*'],
      seq_len=8, batch_size=4, data_seed=5).Set(**kwargs)


def _ReferenceStream(names):
  tokens = []
  for name in sorted(names):
    tokens += [EOD] + list(_FILES[name])
  return np.array(tokens)


def _ReferenceWindows(names, seq_len):
  stream = _ReferenceStream(names)
  count = (len(stream) - 1) // seq_len
  return np.stack([stream[k * seq_len:k * seq_len + seq_len + 1]
                   for k in range(count)])


_TRAIN = ['a/one.py', 'a/two.py', 'b/three.py']
_HELD = ['held/five.py', 'held/four.py']


def test_windows_are_the_files_bytes_in_order_packed(root):
  gen = _Params(root).Instantiate()
  want = _ReferenceWindows(_TRAIN, 8)
  count = gen.stream.num_windows(8)
  assert count == len(want)
  np.testing.assert_array_equal(gen.Windows(range(count)), want)
  # Consecutive windows' labels tile the stream: the packing drops nothing.
  labels = gen.Windows(range(count))[:, 1:].reshape([-1])
  np.testing.assert_array_equal(labels,
                                _ReferenceStream(_TRAIN)[1:1 + 8 * count])


def test_split_by_pattern_keeps_held_out_files_out_of_training(root):
  gen = _Params(root).Instantiate()
  assert sorted(gen.train_files) == [str(root / n) for n in _TRAIN]
  assert sorted(gen.held_out_files) == [str(root / n) for n in _HELD]
  held = _Params(root, split='held_out', held_out_windows=4).Instantiate()
  np.testing.assert_array_equal(
      held.Windows(range(held.stream.num_windows(8))),
      _ReferenceWindows(_HELD, 8))
  # Every training window of two epochs is training bytes.
  train_stream = _ReferenceStream(_TRAIN)
  steps = 2 * gen.stream.num_windows(8) // 4 + 1
  for step in range(steps):
    for window in gen.Windows(gen.TrainWindows(step)):
      assert _Contains(train_stream, window)


def _Contains(stream, window):
  n = len(window)
  return any(np.array_equal(stream[i:i + n], window)
             for i in range(len(stream) - n + 1))


def test_split_by_hash_when_no_pattern_matches(root):
  gen = _Params(root, held_out_patterns=['nowhere/*'],
                held_out_fraction=0.3).Instantiate()
  train, held = set(gen.train_files), set(gen.held_out_files)
  assert train and held and not train & held
  assert train | held == {str(root / n) for n in _FILES}
  held_bytes = sum(len(_FILES[str(p)[len(str(root)) + 1:]]) for p in held)
  assert held_bytes >= 0.3 * sum(len(d) for d in _FILES.values())
  again = _Params(root, held_out_patterns=['nowhere/*'],
                  held_out_fraction=0.3).Instantiate()
  assert again.held_out_files == gen.held_out_files


def test_each_epoch_reads_every_window_once_in_a_seeded_order(root):
  gen = _Params(root).Instantiate()
  count = gen.stream.num_windows(8)
  per_epoch = count - count % 4  # steps whose windows lie in epoch 0
  order = np.concatenate([gen.TrainWindows(s) for s in range(per_epoch // 4)])
  assert len(set(order.tolist())) == len(order)
  same = _Params(root).Instantiate()
  other = _Params(root, data_seed=6).Instantiate()
  for step in (0, 3, 11):
    np.testing.assert_array_equal(gen.TrainWindows(step),
                                  same.TrainWindows(step))
  assert any(not np.array_equal(gen.TrainWindows(s), other.TrainWindows(s))
             for s in range(3))


def test_the_graphs_batches_follow_the_global_step(root):
  gen_p = _Params(root)
  with tf.Graph().as_default():
    step = py_utils.GetOrCreateGlobalStepVar()
    gen = gen_p.Instantiate()
    batch = gen.GetPreprocessedInputBatch()
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      for s in (0, 7):
        step.load(s, sess)
        got = sess.run(batch)
        want = gen.Windows(gen.TrainWindows(s))
        np.testing.assert_array_equal(got.ids, want[:, :-1])
        np.testing.assert_array_equal(got.labels, want[:, 1:])
        np.testing.assert_array_equal(got.weights, want[:, 1:] != EOD)
        assert not got.paddings.any()


def test_held_out_batches_cycle_through_the_held_out_windows(root):
  gen_p = _Params(root, split='held_out', held_out_windows=8)
  with tf.Graph().as_default():
    gen = gen_p.Instantiate()
    batch = gen.GetPreprocessedInputBatch()
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.local_variables_initializer())
      reads = [sess.run(batch).labels for _ in range(3)]
  windows = gen.Windows(gen.HeldOutWindows())
  np.testing.assert_array_equal(np.concatenate(reads[:2]), windows[:, 1:])
  np.testing.assert_array_equal(reads[2], reads[0])
  scored = windows[:, 1:][windows[:, 1:] != EOD]
  assert gen.HeldOutBytes() == bytes(scored.astype(np.uint8))


def test_held_out_runs_are_evenly_spaced_consecutive_windows():
  run = 16
  got = text_input.HeldOutWindowIndices(1000, 48, run)
  assert len(got) == 48
  runs = got.reshape([-1, run])
  np.testing.assert_array_equal(runs - runs[:, :1], np.tile(np.arange(run),
                                                            [3, 1]))
  np.testing.assert_array_equal(runs[:, 0], [0, 492, 984])


@pytest.mark.parametrize('change, message', [
    (dict(file_pattern='/nonexistent/**/*.txt'),
     r"file_pattern='/nonexistent/\*\*/\*.txt' matches no file; give a glob"),
    (dict(held_out_patterns=['*']), r'every file of file_pattern=.* is held '
     r'out \(held_out_patterns=\[\'\*\'\]\)'),
    (dict(seq_len=100000), r'fewer than one window of seq_len \+ 1 = 100001'),
    (dict(split='dev'), r"split='dev' must be 'train' or 'held_out'"),
    (dict(split='held_out', held_out_windows=6),
     r'held_out_windows=6 must be a positive multiple of batch_size=4'),
])
def test_bad_params_name_the_param_and_the_fix(root, change, message):
  # In a graph of its own: Lingvo leaves its variable store on the default
  # graph when a layer's __init__ raises (tests/conftest.py).
  with tf.Graph().as_default(), pytest.raises(ValueError, match=message):
    _Params(root).Set(**change).Instantiate()
