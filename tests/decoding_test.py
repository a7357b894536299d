"""Incremental decoding through the pipeline: per-stage states, ExtendStep.

The stage is a causal self-attention block with a key/value cache. Decoding
a sequence one position per call (FPropFn('ExtendStep') with the caches as
padded_per_stage_states) must give, at every position, what the plain
unpipelined stack gives on the full sequence (each layer's FProp in a plain
loop, and independently the NumPy version of the same math); the caches
must hold every layer's keys and values (over pairwise coverings of
S, M, R and graph mode or jit). Where the states live (their slots,
per device when partitioned) and the errors for states of the wrong shape
are in decoding_states_test.py.
"""

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
from gpipe import layers
from gpipe import schedule as schedule_lib
from lingvo import compat as tf
from lingvo.core import base_layer
from lingvo.core import py_utils
from tests import close
from tests import covering
from tests import sessions

NestedMap = py_utils.NestedMap

DIM = 4
SEQ = 5


class CachedAttentionBody(base_layer.BaseLayer):
  """x + causal self-attention(x), then + tanh(. @ w1); with a k/v cache.

  FProp(theta, x [b, t, d]) -> [b, t, d] on a whole sequence.
  InitStates(theta, batch_size) -> NestedMap(k, v) of zeros [b, max_len, d].
  ExtendStep(theta, x [b, d], cache, time_step) -> (y [b, d], cache with
  position `time_step` written).
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', DIM, 'Model dim.')
    p.Define('max_len', SEQ, 'Cache length.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    # Scale 0.4 keeps activations O(1) through 6 residual layers (0.6 let
    # them reach |28|, where the softmax of scores in the hundreds turned
    # float32 rounding into 5e-5 relative differences between two correct
    # computations of the same attention).
    for name in ('wq', 'wk', 'wv', 'wo', 'w1'):
      self.CreateVariable(name, py_utils.WeightParams(
          [p.dim, p.dim], py_utils.WeightInit.Gaussian(0.4)))

  def FProp(self, theta, x):
    q, k, v = (tf.einsum('btd,de->bte', x, theta[w])
               for w in ('wq', 'wk', 'wv'))
    t = py_utils.GetShape(x)[1]
    scores = tf.einsum('bqd,bkd->bqk', q, k) / np.sqrt(self.params.dim)
    causal = tf.linalg.band_part(tf.ones([t, t]), -1, 0)
    scores += (1.0 - causal[None]) * -1e9
    att = tf.einsum('bqk,bkd->bqd', tf.nn.softmax(scores), v)
    h = x + tf.einsum('btd,de->bte', att, theta.wo)
    return h + tf.tanh(tf.einsum('btd,de->bte', h, theta.w1))

  def InitStates(self, theta, batch_size):
    p = self.params
    zeros = tf.zeros([batch_size, p.max_len, p.dim])
    return NestedMap(k=zeros, v=zeros)

  def ExtendStep(self, theta, x, cache, time_step):
    p = self.params
    q, k, v = (tf.einsum('bd,de->be', x, theta[w]) for w in ('wq', 'wk', 'wv'))
    here = tf.one_hot(time_step, p.max_len)[None, :, None]
    cache = NestedMap(k=cache.k * (1 - here) + k[:, None] * here,
                      v=cache.v * (1 - here) + v[:, None] * here)
    scores = tf.einsum('bd,bkd->bk', q, cache.k) / np.sqrt(p.dim)
    seen = tf.cast(tf.range(p.max_len) <= time_step, tf.float32)
    scores += (1.0 - seen[None]) * -1e9
    att = tf.einsum('bk,bkd->bd', tf.nn.softmax(scores), cache.v)
    h = x + tf.einsum('bd,de->be', att, theta.wo)
    return h + tf.tanh(tf.einsum('bd,de->be', h, theta.w1)), cache


def _NumpyLayer(w, x):
  """The body's FProp in NumPy, for [b, t, d]."""
  q, k, v = (x @ w[n] for n in ('wq', 'wk', 'wv'))
  t = x.shape[1]
  scores = np.einsum('bqd,bkd->bqk', q, k) / np.sqrt(x.shape[-1])
  scores = np.where(np.tril(np.ones([t, t]))[None] > 0, scores, -1e9)
  scores = np.exp(scores - scores.max(-1, keepdims=True))
  att = np.einsum('bqk,bkd->bqd', scores / scores.sum(-1, keepdims=True), v)
  h = x + att @ w['wo']
  return h + np.tanh(h @ w['w1']), k, v


def Params(num_stages, num_microbatches, circular_repeat, unroll='never'):
  """The pipelined CachedAttentionBody decoder of these tests."""
  return layers.PipelinedLayer.Params().Set(
      name='pipe', num_stages=num_stages, num_microbatches=num_microbatches,
      circular_repeat=circular_repeat, unroll=unroll, random_seed=3,
      single_stage_body=CachedAttentionBody.Params())


def _PerLayerWeights(layer, values):
  """{name: value} of each logical layer, repeat-major, from stacked values."""
  p = layer.params
  out = []
  for r in range(p.circular_repeat):
    for s in range(p.num_stages):
      w = {}
      for name, value in values.items():
        value = value[s]
        if p.circular_repeat > 1:
          value = value[r]
        w[name] = value
      out.append(w)
  return out


class _Decoder:
  """Builds the layer and a one-position decode step, in graph mode or jit."""

  def __init__(self, params, batch, mode):
    self.layer = params.Instantiate()
    self.batch = batch
    self.mode = mode
    self.p = self.layer.params

  def InitStates(self):
    """Per-stage caches, padded for the pipeline (or per-layer lists)."""
    layer, p = self.layer, self.p
    if p.unroll == 'always':
      return [layer.body.InitStates(layer.layer_theta(layer.theta, r, s),
                                    self.batch)
              for r in range(p.circular_repeat) for s in range(p.num_stages)]
    per_stage, _ = layer.BodyFPropNoMicrobatching(
        layer.theta.body, 'InitStates', self.batch)
    return tf.nest.map_structure(layer.PadMicrobatches,
                                 layer.MicrobatchStates(per_stage))

  def Step(self, x_t, states, t):
    out = self.layer.FPropFn(self.layer.theta, 'ExtendStep', x_t,
                             padded_per_stage_states=[states],
                             kwargs_no_batch={'time_step': t})
    y, new_states = out
    if self.p.unroll == 'always':
      new_states, = new_states  # the per-layer list of our one state
    return y, new_states


def _Decode(params, x, mode, start=None, first_position=0):
  """Decodes x [b, T, d] one position per call from `first_position`.

  Args:
    params: the layer's Params.
    x: the whole sequence; positions before `first_position` are not fed.
    mode: 'graph' or 'jit'.
    start: start(each layer's weights) -> the starting padded states,
      NestedMap(k, v) of NumPy arrays [T, S, b/M, max_len, d] (made from
      the weights this build of the layer initialized); None for the
      layer's own (zeros from the body's InitStates, microbatched and
      padded by the layer).

  Returns:
    (outputs [b, positions decoded, d], the final states (padded NumPy
    arrays; a per-layer list when unrolled), each layer's weights, the
    layer).
  """
  batch = x.shape[0]
  with tf.Graph().as_default():
    dec = _Decoder(params, batch, mode)
    states0 = dec.InitStates()
    x_t = tf.compat.v1.placeholder(tf.float32, [batch, DIM])
    t = tf.compat.v1.placeholder(tf.int32, [])
    flat0 = tf.nest.flatten(states0)
    holders = [tf.compat.v1.placeholder(s.dtype, s.shape) for s in flat0]
    states_in = tf.nest.pack_sequence_as(states0, holders)
    if mode == 'jit':
      step = tf.function(dec.Step, jit_compile=True, autograph=False)
      y, states_out = step(x_t, states_in, t)
    else:
      y, states_out = dec.Step(x_t, states_in, t)
    with sessions.AsBuilt() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      values = dict(zip([n for n, _ in dec.layer.vars.body.FlattenItems()],
                        sess.run([v for _, v in
                                  dec.layer.vars.body.FlattenItems()])))
      if start is None:
        flat = sess.run(flat0)
      else:
        flat = tf.nest.flatten(start(_PerLayerWeights(dec.layer, values)))
      outs = []
      for i in range(first_position, x.shape[1]):
        feed = dict(zip(holders, flat))
        feed.update({x_t: x[:, i], t: i})
        y_i, flat = sess.run([y, tf.nest.flatten(states_out)], feed)
        outs.append(y_i)
  final = tf.nest.pack_sequence_as(states0, flat)
  decoded = (np.stack(outs, axis=1) if outs else
             np.zeros([batch, 0, DIM], np.float32))
  return (decoded, final,
          _PerLayerWeights(dec.layer, values), dec.layer)


# -- The state slots, by the schedule's table (NumPy). ------------------------
# Slot [i, s] of the padded states holds what stage s works with at
# iteration i: the state of the (microbatch, repeat) the schedule's table
# puts there. Microbatch m is the batch's rows m, m + M, m + 2M, ...


def _SlotOfEachCall(sched):
  """{(microbatch, logical layer): (iteration, stage)}, from the table."""
  slots = {}
  for i, row in enumerate(sched.Table()):
    for s, cell in enumerate(row):
      if cell is not None:
        m, r = cell
        slots[m, r * sched.num_stages + s] = (i, s)
  return slots


def _PadByTable(per_layer, sched):
  """[L, b, ...] each layer's state -> [T, S, b/M, ...] state slots (bubble
  slots hold noise: nothing may read them)."""
  num_mb = sched.num_microbatches
  shape = per_layer.shape
  padded = np.random.RandomState(11).uniform(
      -9, 9, (sched.num_iterations, sched.num_stages, shape[1] // num_mb) +
      shape[2:]).astype(per_layer.dtype)
  for (m, l), (i, s) in _SlotOfEachCall(sched).items():
    padded[i, s] = per_layer[l, m::num_mb]
  return padded


def _UnpadByTable(padded, sched):
  """[T, S, b/M, ...] state slots -> [L, b, ...] each layer's state."""
  num_mb = sched.num_microbatches
  num_layers = sched.num_stages * sched.circular_repeat
  out = np.zeros((num_layers, padded.shape[2] * num_mb) + padded.shape[3:],
                 padded.dtype)
  for (m, l), (i, s) in _SlotOfEachCall(sched).items():
    out[l, m::num_mb] = padded[i, s]
  return out


def _FullSequenceReference(weights, x):
  """The plain stack on the whole sequence: NumPy, layer after layer."""
  keys, vals = [], []
  for w in weights:
    x, k, v = _NumpyLayer(w, x)
    keys.append(k)
    vals.append(v)
  return x, keys, vals


_CONFIGS = [
    # (num_stages, num_microbatches, circular_repeat, batch)
    (1, 1, 1, 2),
    (2, 2, 1, 4),
    (3, 2, 1, 4),
    (4, 3, 1, 6),
    (2, 3, 2, 6),
    (2, 4, 2, 4),
    (3, 2, 2, 4),
]


_MODES = ('graph', 'jit')


_FULL_DECODING = [c + (mode,) for c in _CONFIGS for mode in _MODES]
# Pairwise over (S, the kind of M, R, mode) (covering.py): 12 of the
# product's 14.
_DECODING_FEATURES = (lambda c: c[0], covering.MicrobatchKindOfRow,
                      lambda c: c[2], lambda c: c[4])
_DECODING = covering.Pairwise(_FULL_DECODING, _DECODING_FEATURES)


@pytest.mark.parametrize(
    'num_stages, num_microbatches, circular_repeat, batch, mode', _DECODING)
def test_decoding_matches_the_full_sequence_stack(num_stages, num_microbatches,
                                                  circular_repeat, batch,
                                                  mode):
  CheckDecoding(num_stages, num_microbatches, circular_repeat, batch, mode,
                seed=num_stages * 7 + batch)


@pytest.mark.parametrize('mode', ['graph', 'jit'])
@pytest.mark.parametrize('stream_io', [False, True])
def test_decoding_under_1f1b_and_stream_io(stream_io, mode):
  """Decoding runs forward only: the 1f1b forward loop, and with stream_io
  the streams, carry the states as the reverse loop does."""
  CheckDecoding(3, 2, 2, 4, mode, seed=5, backward_schedule='1f1b',
                stream_io=stream_io)


def CheckDecoding(num_stages, num_microbatches, circular_repeat, batch, mode,
                  seed=3, **extra_params):
  """Decodes step after step with the test decoder pipelined (FPropFn
  ('ExtendStep'), each layer's caches as per-stage states; `extra_params`
  set on its Params, e.g. skip_bubbles=True) and checks the outputs and
  every layer's cache against the plain stack on the whole sequence
  (NumPy, on the decoder's weights); the caches are read out of their slots
  by the schedule's table, and the layer's UnpadStates must agree."""
  params = Params(num_stages, num_microbatches, circular_repeat).Set(
      **extra_params)
  x = np.random.RandomState(seed).uniform(
      -1, 1, [batch, SEQ, DIM]).astype(np.float32)
  decoded, final, weights, layer = _Decode(params, x, mode)
  expected, keys, vals = _FullSequenceReference(weights, x)
  close.AssertClose(decoded, expected, close.FLOAT32_AT_SCALE)
  # Every layer's keys and values at every position: [L, B, max_len, d].
  sched = layer.Schedule(num_microbatches)
  close.AssertClose(_UnpadByTable(final.k, sched), np.stack(keys),
                    close.FLOAT32_AT_SCALE)
  close.AssertClose(_UnpadByTable(final.v, sched), np.stack(vals),
                    close.FLOAT32_AT_SCALE)
  with tf.Graph().as_default(), sessions.AsBuilt() as sess:
    unpadded = sess.run(layer.UnpadStates(
        tf.nest.map_structure(tf.constant, final)))
  assert unpadded.k.shape == (num_stages * circular_repeat, batch, SEQ, DIM)
  np.testing.assert_array_equal(unpadded.k, _UnpadByTable(final.k, sched))
  np.testing.assert_array_equal(unpadded.v, _UnpadByTable(final.v, sched))


_PREFIX = 2


_FULL_FROM_CACHE = [
    c + (mode,) for c in
    [(2, 2, 1, 4, {}), (3, 2, 1, 6, {}), (4, 4, 1, 8, {}), (2, 3, 2, 6, {}),
     (3, 2, 2, 4, {}), (2, 4, 3, 8, {}),
     (3, 2, 2, 4, dict(backward_schedule='1f1b', stream_io=True))]
    for mode in _MODES]
# Pairwise over (S, the kind of M, R, 1f1b + stream_io or not, mode)
# (covering.py): 11 of the product's 14.
_FROM_CACHE_FEATURES = (lambda c: c[0], covering.MicrobatchKindOfRow,
                        lambda c: c[2], lambda c: bool(c[4]),
                        lambda c: c[5])
_FROM_CACHE = covering.Pairwise(_FULL_FROM_CACHE, _FROM_CACHE_FEATURES)


@pytest.mark.parametrize(
    'num_stages, num_microbatches, circular_repeat, batch, extra, mode',
    _FROM_CACHE)
def test_decoding_goes_on_from_each_layers_own_cache(
    num_stages, num_microbatches, circular_repeat, batch, extra, mode):
  """Starting caches that differ per layer and per example: the plain
  stack's keys and values of a prefix (and noise after it, where nothing
  may read), put in their slots by the schedule's table. Decoding the rest
  of the sequence must give the plain stack's outputs there: a cache in
  the wrong slot (another stage's, another microbatch's, another repeat's)
  changes them."""
  rng = np.random.RandomState(num_stages + 10 * batch)
  x = rng.uniform(-1, 1, [batch, SEQ, DIM]).astype(np.float32)
  params = Params(num_stages, num_microbatches, circular_repeat).Set(**extra)
  sched = schedule_lib.Schedule(num_stages, num_microbatches, circular_repeat)

  def Prefix(per_layer):
    cache = np.stack(per_layer)
    cache[:, :, _PREFIX:] = rng.uniform(-5, 5, cache[:, :, _PREFIX:].shape)
    return _PadByTable(cache, sched)

  def Start(weights):
    _, keys, vals = _FullSequenceReference(weights, x)
    return NestedMap(k=Prefix(keys), v=Prefix(vals))

  decoded, final, weights, _ = _Decode(params, x, mode, start=Start,
                                       first_position=_PREFIX)
  expected, keys, _ = _FullSequenceReference(weights, x)
  assert decoded.shape == (batch, SEQ - _PREFIX, DIM)
  close.AssertClose(decoded, expected[:, _PREFIX:], close.FLOAT32_AT_SCALE)
  close.AssertClose(_UnpadByTable(final.k, sched), np.stack(keys),
                    close.FLOAT32_AT_SCALE)


@pytest.mark.parametrize('num_stages, num_microbatches, circular_repeat',
                         [(3, 2, 1), (2, 3, 2), (4, 4, 1), (2, 4, 3)])
def test_the_layers_state_padding_follows_the_table(num_stages,
                                                    num_microbatches,
                                                    circular_repeat):
  """PadMicrobatches(MicrobatchStates(.)) of per-stage, per-example states:
  every repeat of stage s starts from stage s's state of its examples."""
  batch = 2 * num_microbatches
  per_stage = np.random.RandomState(num_stages).uniform(
      -1, 1, [num_stages, batch, SEQ, DIM]).astype(np.float32)
  with tf.Graph().as_default():
    layer = Params(num_stages, num_microbatches,
                   circular_repeat).Instantiate()
    padded = layer.PadMicrobatches(
        layer.MicrobatchStates(tf.constant(per_stage)))
    with sessions.AsBuilt() as sess:
      padded = sess.run(padded)
  sched = layer.Schedule(num_microbatches)
  per_layer = np.concatenate([per_stage] * circular_repeat)
  assert padded.shape == _PadByTable(per_layer, sched).shape
  for (m, l), (i, s) in _SlotOfEachCall(sched).items():
    np.testing.assert_array_equal(padded[i, s],
                                  per_stage[l % num_stages, m::num_microbatches])


@pytest.mark.parametrize('mode', ['graph', 'jit'])
@pytest.mark.parametrize('num_stages, circular_repeat', [(2, 1), (2, 2)])
def test_unrolled_decoding_with_per_layer_state_lists(num_stages,
                                                      circular_repeat, mode):
  x = np.random.RandomState(5).uniform(-1, 1, [4, SEQ, DIM]).astype(
      np.float32)
  params = Params(num_stages, 2, circular_repeat, unroll='always')
  decoded, caches, weights, _ = _Decode(params, x, mode)
  expected, keys, _ = _FullSequenceReference(weights, x)
  close.AssertClose(decoded, expected, close.FLOAT32_AT_SCALE)
  assert len(caches) == num_stages * circular_repeat
  for cache, k in zip(caches, keys):
    close.AssertClose(cache.k, k, close.FLOAT32_AT_SCALE)


def test_the_test_body_extend_step_matches_its_fprop():
  # The body itself: FProp on the full sequence vs NumPy, so the references
  # above test the pipeline, not a broken body.
  rng = np.random.RandomState(0)
  x = rng.uniform(-1, 1, [3, SEQ, DIM]).astype(np.float32)
  with tf.Graph().as_default():
    body = CachedAttentionBody.Params().Set(name='b').Instantiate()
    y = body.FProp(body.theta, tf.constant(x))
    with sessions.AsBuilt() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      y, w = sess.run([y, dict(body.theta)])
  np.testing.assert_allclose(y, _NumpyLayer(w, x)[0], rtol=1e-5, atol=1e-5)


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))
