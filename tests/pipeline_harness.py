"""Builds a pipelined layer and its independent references, in either mode.

The references never call the layer's code: weights are read from the
layer's variables and sliced per logical layer here (layer r * S + s), then
the body's math (tests/reference_bodies.py) is applied layer after layer in
a plain Python loop — in NumPy for the forward pass, and in TensorFlow, op
by op, for gradients (TF autodiff of the plain loop, on the weights'
values after the layer ran).

Modes:
  'graph': tf.Graph + tf.compat.v1.Session, tf.gradients (Lingvo's home).
  'jit':   TF2, tf.function(jit_compile=True) with tf.GradientTape.
"""

import dataclasses
import threading
from typing import Any

import numpy as np

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe import layers
from gpipe import recurrent
from lingvo.core import py_utils
from tests import close
from tests import reference_bodies
from tests import sessions

NestedMap = py_utils.NestedMap

# Largest errors seen across the run, reported at the end of the session.
_ERRORS = {'abs': 0.0, 'rel': 0.0, 'checks': 0}
_ERRORS_LOCK = threading.Lock()


def LargestErrors():
  return dict(_ERRORS)


@dataclasses.dataclass
class Case:
  """One configuration of the pipelined layer and its inputs."""
  num_stages: int = 2
  num_microbatches: Any = 2
  microbatch_size: Any = None
  circular_repeat: int = 1
  body: str = 'dense'  # dense | dense_rows | multi | stage_parallel
  per_stage_vars: bool = False
  shard_stages_1d: bool = False
  # Stage dim over axis 0 of a [S, 2] device mesh instead.
  pipeline_stage_mesh_dim: bool = False
  batch: int = 4
  # Shape of one example, last dim = feature dim.
  example_shape: tuple = (3, 4)
  kwargs: bool = False  # per-example `scale` kwarg.
  kwargs_no_batch: bool = False  # an unsliced `shift` via FPropFn.
  premicrobatched: bool = False  # inputs already [M, mb, ...]
  remat_policy: Any = None  # None: the layer's default
  store_body_intermediates: bool = False
  unroll: str = 'never'
  vectorize_stages: str = 'auto'  # on one device: all stages at once
  skip_bubbles: bool = False  # on one device: fill/drain on half the stages
  layer_by_layer: bool = False  # on one device: no schedule, no bubbles
  # Graph mode: the sweeps run the loops op by op. Compiled (the Param's
  # default), each case's loops would cost XLA about half a second to
  # compile; tests/loops/compiled_loops_test.py checks the compiled loops of
  # every schedule against the same references.
  compile_loops: str = 'never'
  backward_schedule: str = 'reverse'  # or '1f1b'
  stream_io: bool = False  # inputs and outputs split over the stages
  delayed_sends: bool = False  # each hand-off one iteration later
  seed: int = 0

  @property
  def dim(self):
    return self.example_shape[-1]

  def Params(self):
    if self.body in ('dense', 'dense_rows'):
      cls = dict(dense=reference_bodies.DenseBody,
                 dense_rows=reference_bodies.RowsDenseBody)[self.body]
      body = dict(single_stage_body=cls.Params().Set(dim=self.dim))
    elif self.body == 'multi':
      body = dict(single_stage_body=(
          reference_bodies.MultiInputBody.Params().Set(dim=self.dim)))
    else:
      body = dict(stage_parallel_body=(
          reference_bodies.StageParallelDenseBody.Params().Set(
              dim=self.dim, num_stages=self.num_stages)))
    return layers.PipelinedLayer.Params().Set(
        name='pipe',
        num_stages=self.num_stages,
        num_microbatches=(None
                          if self.premicrobatched else self.num_microbatches),
        microbatch_size=None if self.premicrobatched else self.microbatch_size,
        circular_repeat=self.circular_repeat,
        per_stage_vars=self.per_stage_vars,
        shard_stages_1d=self.shard_stages_1d,
        pipeline_stage_mesh_dim=0 if self.pipeline_stage_mesh_dim else None,
        device_mesh=(np.arange(2 * self.num_stages).reshape(
            self.num_stages, 2) if self.pipeline_stage_mesh_dim else None),
        remat_policy=self.remat_policy,
        store_body_intermediates=self.store_body_intermediates,
        unroll=self.unroll,
        vectorize_stages=self.vectorize_stages,
        skip_bubbles=self.skip_bubbles,
        layer_by_layer=self.layer_by_layer,
        compile_loops=self.compile_loops,
        backward_schedule=self.backward_schedule,
        stream_io=self.stream_io,
        delayed_sends=self.delayed_sends,
        random_seed=1234 + self.seed,
        **body)


def _Inputs(case):
  """NumPy inputs, kwargs and output cotangents for a case."""
  rng = np.random.RandomState(case.seed)
  shape = (case.batch,) + tuple(case.example_shape)
  x = rng.uniform(-1, 1, shape).astype(np.float32)
  args = [x]
  if case.body == 'multi':
    args = [
        x, None, {
            'a': rng.uniform(-1, 1, shape).astype(np.float32),
            'b': rng.uniform(-1, 1, shape[:-1]).astype(np.float32),
        }
    ]
  kwargs = {}
  if case.kwargs:
    kwargs['scale'] = rng.uniform(0.5, 1.5, (case.batch,) + (1,) *
                                  len(case.example_shape)).astype(np.float32)
  no_batch = {}
  if case.kwargs_no_batch:
    no_batch['shift'] = np.float32(0.25)
  return args, kwargs, no_batch


def PerLayerWeights(case, var_values):
  """Slices the layer's variable values into [layer] -> {name: array}.

  Written against the documented variable layouts, not the layer's code:
    single_stage_body:   body/<v> [S, (R,) ...]
    per_stage_vars:      body_iter_<s>/<v> [(R,) ...]
    stage_parallel_body: body/<v> [(R,) S, ...]
  """
  s_count, r_count = case.num_stages, case.circular_repeat
  weights = []
  for r in range(r_count):
    for s in range(s_count):
      if case.per_stage_vars:
        vals = var_values['body_iter_%05d' % s]
        w = {k: (v[r] if r_count > 1 else v) for k, v in vals.items()}
      elif case.body == 'stage_parallel':
        w = {k: (v[r][s] if r_count > 1 else v[s])
             for k, v in var_values['body'].items()}
      else:
        w = {k: (v[s][r] if r_count > 1 else v[s])
             for k, v in var_values['body'].items()}
      weights.append(w)
  return weights


def SequentialReference(xp, case, weights, args, kwargs, no_batch):
  """The plain stack: every logical layer in order on the whole batch."""
  shift = no_batch.get('shift')
  scale = kwargs.get('scale')
  if case.body == 'multi':
    x, _, nested = args
    for w in weights:
      x, nested = reference_bodies.MultiInputFn(xp, w['w'], w['v'], x, nested)
    return [x, None, nested]
  x = args[0]
  for w in weights:
    x = reference_bodies.DenseFn(xp, w['w'], w['b'], x, scale, shift)
  return [x]


def _Cotangents(outputs, seed):
  rng = np.random.RandomState(seed + 100)
  return tf.nest.map_structure(
      lambda o: None if o is None else rng.uniform(-1, 1, o.shape).astype(
          np.float32), outputs)


def _Loss(outputs, cotangents):
  terms = [
      tf.reduce_sum(o * c)
      for o, c in zip(tf.nest.flatten(outputs), tf.nest.flatten(cotangents))
      if o is not None
  ]
  return tf.add_n(terms)


def _ToTf(tree, watch=None):
  """NumPy tree -> constant tensors; `watch` (a tape's) sees each of them."""

  def Const(v):
    if v is None:
      return None
    t = tf.constant(v)
    if watch is not None:
      watch(t)
    return t

  return tf.nest.map_structure(Const, tree)


def _Premicrobatch(case, tree):
  """[B, ...] -> [M, B/M, ...] the way the layer documents (row m + k*M)."""
  m = case.num_microbatches

  def Split(v):
    if v is None or np.ndim(v) == 0:
      return v
    v = v.reshape((v.shape[0] // m, m) + v.shape[1:])
    return np.swapaxes(v, 0, 1).copy()

  return tf.nest.map_structure(Split, tree)


def _Unpremicrobatch(case, tree):
  del case

  def Merge(v):
    if v is None:
      return v
    v = np.swapaxes(v, 0, 1)
    return v.reshape((-1,) + v.shape[2:])

  return tf.nest.map_structure(Merge, tree)


def _Pipelined(layer, case, args, kwargs, no_batch, cotangents, watch=None):
  """Builds the pipelined layer's outputs and loss; returns the tensors
  to fetch and to differentiate by."""
  p_args, p_kwargs = args, kwargs
  if case.premicrobatched:
    p_args, p_kwargs = (_Premicrobatch(case, args),
                        _Premicrobatch(case, kwargs))
    cotangents = _Premicrobatch(case, cotangents)
  p_args, p_kwargs = _ToTf(p_args, watch), _ToTf(p_kwargs)
  if case.body == 'multi':
    p_args[2] = NestedMap(p_args[2])
  if case.kwargs_no_batch:
    out = layer.FPropFn(layer.theta, 'FProp', *p_args,
                        padded_per_stage_states=[],
                        kwargs_no_batch=_ToTf(no_batch), **p_kwargs)
  else:
    out = layer.FProp(layer.theta, *p_args, **p_kwargs)
  out = list(out) if isinstance(out, tuple) else [out]
  return dict(out=out, loss=_Loss(out, _ToTf(cotangents)),
              by=tf.nest.flatten(layer.vars) + [p_args[0]])


def _TfReference(case, var_values, args, kwargs, no_batch, cotangents):
  """The TF reference on the values of the layer's weights, run beside the
  layer, not in its graph or compiled function: it checks the same numbers
  and costs no build or compile per case. Op by op (eagerly); under TF1
  behaviour (disable_v2_behavior, as Lingvo's trainer runs) in a graph of
  its own."""
  if tf.executing_eagerly():
    return _Numpy(_ReferenceAndGradients(case, var_values, args, kwargs,
                                         no_batch, cotangents))
  with tf.Graph().as_default():
    fetches = _ReferenceAndGradients(case, var_values, args, kwargs, no_batch,
                                     cotangents)
    with sessions.AsBuilt() as sess:
      return _SessionRun(sess, fetches)


def _ReferenceAndGradients(case, var_values, args, kwargs, no_batch,
                           cotangents):
  """The plain stack's outputs and, by TF's autodiff of it, the gradients
  of its loss w.r.t. each weight (in tf.nest.flatten's order of the
  layer's variables, as the pipelined gradients are) and the first input."""
  stacked = tf.nest.map_structure(tf.constant, var_values)
  with tf.GradientTape() as tape:
    tape.watch(tf.nest.flatten(stacked))
    t_args = _ToTf(args, tape.watch)
    ref = SequentialReference(reference_bodies.TF, case,
                              PerLayerWeights(case, stacked), t_args,
                              _ToTf(kwargs), _ToTf(no_batch))
    loss = _Loss(ref, _ToTf(cotangents))
  grads = tape.gradient(loss, tf.nest.flatten(stacked) + [t_args[0]])
  return _Fetchable(ref), _Dense(grads)


def _Numpy(tree):
  return tf.nest.map_structure(lambda v: None if v is None else v.numpy(),
                               tree)


def _VarValues(layer):
  return {k: dict(child.items()) for k, child in layer.vars.items()}


def RunCase(case, mode):
  """Runs a case; returns a dict of NumPy results for Compare*()."""
  args, kwargs, no_batch = _Inputs(case)
  if mode == 'graph':
    with tf.Graph().as_default():
      tf.compat.v1.set_random_seed(case.seed)
      layer = case.Params().Instantiate()
      cotangents = _CotangentsFor(layer, case, args, kwargs, no_batch)
      t = _Pipelined(layer, case, args, kwargs, no_batch, cotangents)
      grads = _Dense(tf.gradients(t['loss'], t['by']))
      with sessions.AsBuilt() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        res = _SessionRun(sess, dict(out=_Fetchable(t['out']), grads=grads,
                                     vars=_VarValues(layer)))
  else:
    # Eager random ops with an op seed also count how often that seed ran
    # in the process; resetting the global seed makes the weights a
    # function of the case alone, not of the tests run before it.
    tf.random.set_seed(case.seed)
    layer = case.Params().Instantiate()
    cotangents = _CotangentsFor(layer, case, args, kwargs, no_batch)

    @tf.function(jit_compile=True)
    def Step():
      with tf.GradientTape() as tape:
        t = _Pipelined(layer, case, args, kwargs, no_batch, cotangents,
                       watch=tape.watch)
      return dict(out=_Fetchable(t['out']),
                  grads=_Dense(tape.gradient(t['loss'], t['by'])))

    res = _Numpy(Step())
    res['vars'] = _Numpy(_VarValues(layer))
  if case.premicrobatched:
    res['out'] = _Unpremicrobatch(case, res['out'])
    res['grads'][-1] = _Unpremicrobatch(case, res['grads'][-1])
  res['ref'], res['ref_grads'] = _TfReference(case, res['vars'], args, kwargs,
                                              no_batch, cotangents)
  res['layer'] = layer
  res['np_ref'] = SequentialReference(
      reference_bodies.NP, case, PerLayerWeights(case, res['vars']), args,
      kwargs, no_batch)
  return res


def _CotangentsFor(layer, case, args, kwargs, no_batch):
  """Output cotangents shaped as the plain stack's outputs (from NumPy,
  on zero weights of the layer's shapes)."""
  probe = SequentialReference(reference_bodies.NP, case, PerLayerWeights(
      case, _ZeroValues(layer, case)), args, kwargs, no_batch)
  return _Cotangents(probe, case.seed)


def _ZeroValues(layer, case):
  del case
  return {
      k: {n: np.zeros(v.shape.as_list(), np.float32) for n, v in child.items()}
      for k, child in layer.vars.items()
  }


def _Dense(grads):
  """Gradients as dense tensors (a gather's gradient is IndexedSlices)."""
  return [None if g is None else tf.convert_to_tensor(g) for g in grads]


def _Fetchable(tree):
  """Outputs as plain lists/dicts with None leaves kept as None."""
  return [dict(o) if isinstance(o, dict) else o for o in tree]


def _SessionRun(sess, fetches):
  """sess.run that passes None leaves through (sessions cannot fetch None)."""
  flat = tf.nest.flatten(fetches)
  real = [x for x in flat if x is not None]
  values = iter(sess.run(real))
  return tf.nest.pack_sequence_as(
      fetches, [None if x is None else next(values) for x in flat])


def _Record(actual, expected):
  diff = np.abs(np.asarray(actual, np.float64) - expected)
  abs_err = float(diff.max()) if diff.size else 0.0
  scale = np.maximum(np.abs(expected), 1.0)
  rel_err = float((diff / scale).max()) if diff.size else 0.0
  with _ERRORS_LOCK:
    _ERRORS['abs'] = max(_ERRORS['abs'], abs_err)
    _ERRORS['rel'] = max(_ERRORS['rel'], rel_err)
    _ERRORS['checks'] += 1


def CheckCase(case, mode, tolerance=close.FLOAT32):
  """Pipelined == NumPy sequential (forward) == TF plain loop (grads)."""
  res = RunCase(case, mode)
  close.AssertClose(res['out'], res['np_ref'], tolerance,
                    'forward vs NumPy reference', record=_Record)
  close.AssertClose(res['out'], res['ref'], tolerance,
                    'forward vs TF reference', record=_Record)
  assert len(res['grads']) == len(res['ref_grads'])
  for i, (g, r) in enumerate(zip(res['grads'], res['ref_grads'])):
    assert r is not None, f'reference gradient {i} is None'
    assert g is not None, f'pipelined gradient {i} is None'
    assert np.abs(r).max() > 0, f'reference gradient {i} is all zero'
    close.AssertClose(g, r, tolerance, f'gradient {i}', record=_Record)
  return res


def CheckPartitionedStagesOnAMesh(params, input_shape, num_devices):
  """A 1f1b layer whose stages lie on axis 0 of a mesh: its four loops
  (forward, the gradient loop's three phases) move data by
  collective-permutes alone, and its partitioned training step equals the
  same step on one device (which the sweeps check against the plain
  stack)."""
  # Imported here: the partitioning check needs jax, the rest of the
  # harness does not.
  from gpipe import check_partitioning  # pylint: disable=g-import-not-at-top
  report = check_partitioning.CheckPartitioning(params, [input_shape],
                                                num_devices)
  assert len(report.run.loops) == 4, report.run.loops
  for loop in range(4):
    kinds = set(report.run.LoopCounts(loop))
    assert kinds == {'collective-permute'}, (loop, kinds)
  for name, got, want in zip(report.step.ResultNames(), report.run.outputs,
                             report.expected):
    assert np.abs(want).max() > 0, name
    close.AssertClose(got, want, close.FLOAT32, name)
  assert not report.Problems(1e-5), report.Problems(1e-5)


def CheckPartitionedEqualsOneDevice(**one_device_param):
  """A circular 4-stage layer split over 4 virtual devices runs each
  device's stage in one loop forward and one backward, with one
  collective-permute per forward iteration, and its training step equals
  the same layer's on one device, where `one_device_param` (e.g.
  skip_bubbles=True) changes how the one device runs it."""
  # Imported here: the partitioning check needs jax, the rest of the
  # harness does not.
  from gpipe import check_partitioning  # pylint: disable=g-import-not-at-top
  from gpipe.xla import partitioning  # pylint: disable=g-import-not-at-top
  if not partitioning.IsAvailable():
    raise AssertionError('jax and jaxlib are needed (they are in the test '
                         'extra).')
  params = Case(num_stages=4, num_microbatches=4, circular_repeat=2,
                batch=12, shard_stages_1d=True, **one_device_param).Params()
  report = check_partitioning.CheckPartitioning(params, [(12, 3, 4)], 4)
  assert len(report.run.loops) == 2, report.run.loops
  assert report.run.LoopCounts(0) == {'collective-permute': 1}
  names = report.step.ResultNames()
  for name, got, want in zip(names, report.run.outputs, report.expected):
    assert np.abs(want).max() > 0, name
    close.AssertClose(got, want, close.FLOAT32, name)


def RecordRematPolicies(monkeypatch):
  """A list that fills, in order, with the remat policy each loop built
  through gpipe.recurrent.Recurrent is given (the pipeline's and the
  layers' loops both are)."""
  used = []
  build = recurrent.Recurrent

  def Recording(*args, remat_policy, **kwargs):
    used.append(remat_policy)
    return build(*args, remat_policy=remat_policy, **kwargs)

  monkeypatch.setattr(recurrent, 'Recurrent', Recording)
  return used
