"""Text files as byte windows for a language model: a Lingvo input generator.

The files matching `file_pattern` (by default the Python standard library's
own `.py` sources, found at run time) are read as one stream of tokens:

    EOD bytes-of-file-0 EOD bytes-of-file-1 EOD ...

where a token is a byte (ids 0-255) and EOD (id 256, `EOD_ID`) marks where
a file begins; the vocabulary is `VOCAB_SIZE` = 257. The stream is cut into
windows of seq_len + 1 tokens, window k starting at token k * seq_len (each
window's last token is the next one's first), so that the labels of
consecutive windows tile the stream. A row of a batch is one window:

    ids     = window[:-1]          labels  = window[1:]
    weights = 1 where the label is a byte, 0 where it is EOD
    paddings = 0                   (every window is full)

so the weighted loss is nats per byte of text, and bits per byte is it
divided by ln 2: the same measure as a compressor's output bits over its
input bytes.

Train/held-out split, by file: a file whose path relative to the pattern's
root (the part of `file_pattern` before its first wildcard) matches one of
`held_out_patterns` is held out (by default the packages email, json and
asyncio of the standard library). If no file matches them (a user's own
files), files are held out by a hash of their relative path, in that hash
order, until they hold `held_out_fraction` of the bytes (at least one
file). The training stream and the held-out stream are made of disjoint
files, so no held-out byte is ever trained on.

Training batches are a function of (data_seed, global step): epoch e reads
the training windows in the order of a permutation seeded by (data_seed,
e), B windows a step, so a resumed run sees what it would have seen and
every window is read once an epoch. Nothing is loaded whole: the generator
keeps the file list and sizes, and reads each window's bytes from its
file(s) when a batch is made. The held-out set is `held_out_windows` fixed
windows, in runs of consecutive windows (about 4 KB each,
`HELD_OUT_RUN_TOKENS`) evenly spaced over the held-out stream, so that
each run is contiguous text, as a compressor reads it (`HeldOutBytes`);
its batches are read in turn, cyclically, as CopyTaskInput's held-out
batches are.
"""

import bisect
import fnmatch
import functools
import glob
import os
import re
import sysconfig
import zlib

import numpy as np

from lingvo import compat as tf
from lingvo.core import base_input_generator
from lingvo.core import py_utils

NUM_BYTES = 256
EOD_ID = 256  # the token before each file's first byte
VOCAB_SIZE = 257
HELD_OUT_RUN_TOKENS = 4096  # about this much contiguous text per held-out run


def StdlibPattern():
  """The standard library's .py sources of the Python running this."""
  return os.path.join(sysconfig.get_paths()['stdlib'], '**', '*.py')


class TextInput(base_input_generator.BaseInputGenerator):
  """Byte windows of text files (see the module docstring)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('file_pattern', StdlibPattern(),
             'Glob pattern of the text files (`**` matches any directories). '
             "Default: the standard library's .py sources of this Python.")
    p.Define('exclude_patterns', ['site-packages/*', 'dist-packages/*'],
             'Files left out: fnmatch patterns of the path relative to the '
             "pattern's root (the default leaves out installed packages).")
    p.Define('held_out_patterns', ['email/*', 'json/*', 'asyncio/*'],
             'Files held out of training: fnmatch patterns of the path '
             "relative to the pattern's root. If none matches, "
             'held_out_fraction decides.')
    p.Define('held_out_fraction', 0.05,
             'When held_out_patterns match no file: hold out files by a '
             'hash of their relative path until they hold this fraction of '
             'the bytes (at least one file).')
    p.Define('seq_len', 256, 'Tokens a row: windows of seq_len + 1 tokens.')
    p.Define('data_seed', 1234, 'Seed of the order of the training windows.')
    p.Define('split', 'train', "'train' or 'held_out'.")
    p.Define('held_out_windows', 256,
             'Windows in the held-out set (split=held_out); a multiple of '
             'batch_size.')
    p.batch_size = 32
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.ValidateParams(p)
    self.train_files, self.held_out_files = SplitFiles(p)
    self.stream = ByteStream(self.held_out_files if p.split == 'held_out'
                             else self.train_files)
    if self.stream.num_windows(p.seq_len) < 1:
      raise ValueError(
          f'TextInput: the {p.split} files of file_pattern={p.file_pattern!r} '
          f'hold {self.stream.num_tokens} tokens, fewer than one window of '
          f'seq_len + 1 = {p.seq_len + 1}; lower seq_len or add files.')
    self._permutations = {}
    self._held_out_counter = None

  @classmethod
  def ValidateParams(cls, p):
    """Clear errors for Params that cannot work, before any file is read."""
    if p.seq_len < 1:
      raise ValueError(f'TextInput: seq_len={p.seq_len} must be at least 1.')
    if p.batch_size < 1:
      raise ValueError(f'TextInput: batch_size={p.batch_size} must be at '
                       'least 1.')
    if p.split not in ('train', 'held_out'):
      raise ValueError(f"TextInput: split={p.split!r} must be 'train' or "
                       "'held_out'.")
    if p.split == 'held_out' and (p.held_out_windows < p.batch_size or
                                  p.held_out_windows % p.batch_size):
      raise ValueError(f'TextInput: held_out_windows={p.held_out_windows} '
                       f'must be a positive multiple of batch_size='
                       f'{p.batch_size}.')
    if not 0 < p.held_out_fraction < 1:
      raise ValueError(f'TextInput: held_out_fraction={p.held_out_fraction} '
                       'must be between 0 and 1.')

  @classmethod
  def SequenceLength(cls, p):
    """(tokens a row, what sets it), for the task's checks."""
    return p.seq_len, 'input.seq_len'

  @classmethod
  def VocabSize(cls, p):
    del p
    return VOCAB_SIZE

  # -- Which windows a batch holds. -------------------------------------------

  def TrainWindows(self, step):
    """The training window indices [batch_size] of global step `step`."""
    p = self.params
    count = self.stream.num_windows(p.seq_len)
    first = step * p.batch_size
    indices = []
    for position in range(first, first + p.batch_size):
      epoch, i = divmod(position, count)
      indices.append(self._Permutation(epoch, count)[i])
    return np.array(indices, np.int64)

  def _Permutation(self, epoch, count):
    if epoch not in self._permutations:
      rng = np.random.default_rng([self.params.data_seed, epoch])
      self._permutations = {epoch: rng.permutation(count)}  # the latest only
    return self._permutations[epoch]

  def HeldOutWindows(self):
    """Every held-out window index [held_out_windows], in reading order."""
    p = self.params
    return HeldOutWindowIndices(self.stream.num_windows(p.seq_len),
                                p.held_out_windows,
                                max(1, HELD_OUT_RUN_TOKENS // p.seq_len))

  def Windows(self, indices):
    """Windows [n, seq_len + 1] int32 of the stream, by index."""
    length = self.params.seq_len
    return np.stack([self.stream.Read(i * length, i * length + length + 1)
                     for i in indices])

  def HeldOutBytes(self):
    """The held-out set's scored bytes, in order: its labels that are bytes
    (EOD dropped), what a compressor is given to compare with the model."""
    labels = self.Windows(self.HeldOutWindows())[:, 1:].reshape([-1])
    return labels[labels < NUM_BYTES].astype(np.uint8).tobytes()

  def HeldOutPrompt(self, length, line_start=b''):
    """A prompt [length] int32 of held-out text: from the first line of the
    held-out windows that begins with `line_start` (unindented if one is,
    else after its indentation), or from the first window's start where no
    line does (or line_start is empty)."""
    p = self.params
    windows = self.HeldOutWindows()
    begin = windows[0] * p.seq_len
    if line_start:
      labels = self.Windows(windows)[:, 1:].reshape([-1])
      text = np.where(labels < NUM_BYTES, labels, 10).astype(np.uint8)
      for found in LineStarts(text.tobytes(), line_start):
        # The stream position of label `found`: the windows are not all
        # consecutive, the prompt is read from the stream itself.
        at = windows[found // p.seq_len] * p.seq_len + 1 + found % p.seq_len
        if at + length <= self.stream.num_tokens:
          begin = at
          break
    return self.stream.Read(begin, begin + length)

  def BatchOf(self, windows):
    """The NestedMap of numpy arrays the task reads, of windows [b, n + 1]."""
    labels = windows[:, 1:]
    return py_utils.NestedMap(
        ids=windows[:, :-1], labels=labels,
        weights=(labels < NUM_BYTES).astype(np.float32),
        paddings=np.zeros(labels.shape, np.float32))

  # -- The graph. --------------------------------------------------------------

  def _InputBatch(self):
    p = self.params
    if p.split == 'held_out':
      index = self._NextHeldOutIndex()
      read = self._HeldOutBatch
    else:
      index = tf.cast(_GlobalStepOrZero(), tf.int64)
      read = lambda step: self.Windows(self.TrainWindows(int(step)))
    windows = tf.numpy_function(read, [index], tf.int32, stateful=False)
    windows.set_shape([p.batch_size, p.seq_len + 1])
    labels = windows[:, 1:]
    return py_utils.NestedMap(
        ids=windows[:, :-1], labels=labels,
        weights=tf.cast(labels < NUM_BYTES, tf.float32),
        paddings=tf.zeros([p.batch_size, p.seq_len]))

  def _HeldOutBatch(self, index):
    size = self.params.batch_size
    return self.Windows(self.HeldOutWindows()[index * size:(index + 1) * size])

  def _NextHeldOutIndex(self):
    """Batch 0, 1, ..., N - 1, 0, ... of the held-out set, one per read
    (a local variable, as CopyTaskInput's held-out counter)."""
    p = self.params
    if self._held_out_counter is None:
      self._held_out_counter = tf.Variable(
          tf.constant(0, tf.int64), trainable=False, name='held_out_batch',
          collections=[tf.GraphKeys.LOCAL_VARIABLES])
    taken = self._held_out_counter.assign_add(1, use_locking=True) - 1
    return tf.math.floormod(taken, p.held_out_windows // p.batch_size)


class ByteStream:
  """Files read as one token stream, EOD before each, without loading them.

  Only the paths and sizes are kept; `Read` opens the files a range of
  tokens falls in.
  """

  def __init__(self, paths):
    self.paths = list(paths)
    sizes = [os.path.getsize(path) for path in self.paths]
    # starts[i]: the stream position of file i's EOD.
    self.starts = np.concatenate([[0], np.cumsum(np.add(sizes, 1))]).tolist()
    self.num_tokens = self.starts[-1]

  def num_windows(self, seq_len):
    return max(0, (self.num_tokens - 1) // seq_len)

  def Read(self, begin, end):
    """Tokens [begin, end) of the stream, int32."""
    out = []
    i = bisect.bisect_right(self.starts, begin) - 1
    while begin < end:
      start, stop = self.starts[i], self.starts[i + 1]
      if begin == start:
        out.append(np.array([EOD_ID], np.int32))
        begin += 1
      want = min(end, stop) - begin
      if want > 0:
        with open(self.paths[i], 'rb') as f:
          f.seek(begin - start - 1)
          data = f.read(want)
        if len(data) != want:
          raise ValueError(f'TextInput: {self.paths[i]} became shorter while '
                           'training; the files must not change.')
        out.append(np.frombuffer(data, np.uint8).astype(np.int32))
        begin += want
      i += 1
    return np.concatenate(out)


def PatternRoot(pattern):
  """The directory of a glob pattern before its first wildcard: the root
  that relative paths (and held_out_patterns) are taken from."""
  parts = pattern.split(os.sep)
  fixed = next((i for i, part in enumerate(parts) if glob.has_magic(part)),
               len(parts) - 1)  # no wildcard: the file's directory
  return os.sep.join(parts[:fixed]) or (os.sep if pattern.startswith(os.sep)
                                        else os.curdir)


@functools.lru_cache(maxsize=16)
def _MatchedFiles(pattern):
  """(root, sorted relative paths) of the files a glob pattern matches.

  Globbed once a process per pattern (the default, the standard library's
  tree, takes about a second, and a run builds an input generator for each
  of its jobs and checks): files added under the pattern later are seen by
  the next process.
  """
  root = PatternRoot(pattern)
  return root, tuple(sorted(os.path.relpath(f, root)
                            for f in glob.glob(pattern, recursive=True)
                            if os.path.isfile(f)))


def ListFiles(p):
  """(root, sorted relative paths) of the files p.file_pattern matches."""
  root, paths = _MatchedFiles(os.path.expanduser(p.file_pattern))
  kept = [f for f in paths
          if not any(fnmatch.fnmatch(f, x) for x in p.exclude_patterns)]
  if not kept:
    raise ValueError(
        f'TextInput: file_pattern={p.file_pattern!r} matches no file'
        + (f' outside exclude_patterns={p.exclude_patterns}' if paths else '')
        + '; give a glob of your text files, e.g. '
        "input.file_pattern='/path/to/texts/**/*.txt'.")
  return root, kept


def SplitFiles(p):
  """(train paths, held-out paths) of p's files: disjoint (module doc)."""
  root, files = ListFiles(p)
  held = [f for f in files
          if any(fnmatch.fnmatch(f, x) for x in p.held_out_patterns)]
  if not held:
    held = _HeldOutByHash(root, files, p.held_out_fraction)
  held_set = set(held)
  train = [f for f in files if f not in held_set]
  if not train:
    raise ValueError(
        f'TextInput: every file of file_pattern={p.file_pattern!r} is held '
        f'out (held_out_patterns={p.held_out_patterns}); match fewer files '
        'with held_out_patterns, or give more files.')
  return ([os.path.join(root, f) for f in train],
          [os.path.join(root, f) for f in held])


def _HeldOutByHash(root, files, fraction):
  """Files in order of crc32(relative path) until they hold `fraction` of
  the bytes: a split that does not move when files are added elsewhere."""
  sizes = {f: os.path.getsize(os.path.join(root, f)) for f in files}
  total = sum(sizes.values())
  held, size = [], 0
  for f in sorted(files, key=lambda f: (zlib.crc32(f.encode()), f)):
    if held and size >= fraction * total:
      break
    held.append(f)
    size += sizes[f]
  return sorted(held)


def LineStarts(data, line_start):
  """The offsets in data (bytes) of its lines that begin with line_start:
  the unindented ones, then the indented ones (where their indentation
  begins), each in order."""
  for indent in (b'', rb'[ \t]+'):
    for match in re.finditer(rb'(?m)^' + indent + re.escape(line_start),
                             data):
      yield match.start()


def HeldOutWindowIndices(num_windows, count, run):
  """`count` window indices in runs of `run` consecutive windows, the runs
  evenly spaced over num_windows (all windows, repeated, if there are
  fewer)."""
  if num_windows <= count:
    return np.resize(np.arange(num_windows), count)
  run = min(run, count)
  num_runs = -(-count // run)
  firsts = np.linspace(0, num_windows - run, num_runs).astype(np.int64)
  return (firsts[:, None] + np.arange(run)).reshape([-1])[:count]


def _GlobalStepOrZero():
  step = py_utils.GetGlobalStep()
  return tf.constant(0, tf.int64) if step is None else step
