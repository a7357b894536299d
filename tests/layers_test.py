"""PipelinedLayer equals the plain sequential stack: outputs and gradients.

Every case compares the pipelined layer with two references that do not use
the layer's code (see tests/pipeline_harness.py): a NumPy loop over the
logical layers (forward) and TF autodiff of a plain TF loop (gradients w.r.t.
every variable and the input). float32, |err| <= 1e-5 + 1e-5 * |ref|.
"""

import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from tests import covering
from tests import pipeline_harness as harness

Case = harness.Case
MODES = ('graph', 'jit')


def _MicrobatchCounts(num_stages):
  """M in {1, fewer than S, = S, not a multiple of S, many}."""
  counts = {1, num_stages, num_stages + 1, 4 * num_stages}
  if num_stages > 2:
    counts.add(num_stages - 1)
  return sorted(counts)


_FULL_SWEEP = [(s, m, r, mode)
               for s in (1, 2, 3, 4)
               for m in _MicrobatchCounts(s)
               for r in (1, 2, 3)
               for mode in MODES]
# Pairwise (covering.py) over (S, the kind of M, R, mode): every S with every
# kind of M, every S and every kind of M with every R, and each of them in
# both modes (19 of the product's 102, 5 under jit); and M=4 not a multiple
# of S=3 with R=2, the circular schedule that pads a segment, in both modes.
_SWEEP_FEATURES = (lambda c: c[0], covering.MicrobatchKindOfRow,
                   lambda c: c[2], lambda c: c[3])
_SWEEP = covering.Pairwise(_FULL_SWEEP, _SWEEP_FEATURES,
                           must=[(3, 4, 2, mode) for mode in MODES])


@pytest.mark.parametrize('num_stages,num_microbatches,circular_repeat,mode',
                         _SWEEP,
                         ids=[f'S{s}-M{m}-R{r}-{mode}'
                              for s, m, r, mode in _SWEEP])
def test_schedule_sweep(num_stages, num_microbatches, circular_repeat, mode):
  harness.CheckCase(
      Case(
          num_stages=num_stages,
          num_microbatches=num_microbatches,
          circular_repeat=circular_repeat,
          batch=2 * num_microbatches), mode)


# Body kind x per_stage_vars x circular_repeat x shard_stages_1d, with M=4 not
# a multiple of S=3 (so circular schedules pad a segment).
# Pairwise over (body, R, shard, mode): 9 of the product's 36.
_BODIES = [('dense', False), ('dense', True), ('stage_parallel', False)]
_FULL_CONFIGS = [(body, per_stage, r, shard, mode)
                 for body, per_stage in _BODIES
                 for r in (1, 2, 3)
                 for shard in (False, True)
                 for mode in MODES]
_CONFIGS = covering.Pairwise(
    _FULL_CONFIGS, (lambda c: c[:2], lambda c: c[2], lambda c: c[3],
                    lambda c: c[4]))


def _ConfigId(config):
  body, per_stage, r, shard, mode = config
  return (f'{body}{"-per_stage_vars" if per_stage else ""}-R{r}'
          f'{"-shard_stages_1d" if shard else ""}-{mode}')


@pytest.mark.parametrize('config', _CONFIGS,
                         ids=[_ConfigId(c) for c in _CONFIGS])
def test_config_matrix(config):
  body, per_stage, r, shard, mode = config
  harness.CheckCase(
      Case(
          body=body,
          per_stage_vars=per_stage,
          circular_repeat=r,
          shard_stages_1d=shard,
          num_stages=3,
          num_microbatches=4,
          batch=8,
          kwargs=True), mode)


# Pairwise over (body, R, mode): 6 of the product's 12.
_MESH_DIM_CASES = covering.Pairwise(
    [(b, p, r, mode) for b, p in _BODIES for r in (1, 2) for mode in MODES],
    (lambda c: c[:2], lambda c: c[2], lambda c: c[3]))


@pytest.mark.parametrize('body,per_stage,circular_repeat,mode',
                         _MESH_DIM_CASES)
def test_pipeline_stage_mesh_dim(body, per_stage, circular_repeat, mode):
  harness.CheckCase(
      Case(
          body=body,
          per_stage_vars=per_stage,
          pipeline_stage_mesh_dim=True,
          num_stages=2,
          num_microbatches=3,
          circular_repeat=circular_repeat,
          batch=6,
          kwargs=True), mode)


@pytest.mark.parametrize('mode', MODES)
@pytest.mark.parametrize('example_shape', [(4,), (2, 3, 4)],
                         ids=['rank2', 'rank4'])
def test_input_ranks(example_shape, mode):
  """Rank 2 and rank 4 inputs; every other case's are rank 3."""
  harness.CheckCase(
      Case(
          example_shape=example_shape,
          num_stages=2,
          num_microbatches=3,
          circular_repeat=2,
          batch=6), mode)


@pytest.mark.parametrize('mode', MODES)
@pytest.mark.parametrize('circular_repeat', [1, 2])
def test_tuple_and_nested_inputs_with_none(circular_repeat, mode):
  harness.CheckCase(
      Case(
          body='multi',
          num_stages=3,
          num_microbatches=4,
          circular_repeat=circular_repeat,
          batch=8), mode)


@pytest.mark.parametrize('mode', MODES)
def test_microbatch_size_instead_of_num_microbatches(mode):
  harness.CheckCase(
      Case(
          num_stages=2,
          num_microbatches=None,
          microbatch_size=2,
          circular_repeat=2,
          batch=10), mode)


@pytest.mark.parametrize('mode', MODES)
def test_kwargs_are_microbatched_and_kwargs_no_batch_broadcast(mode):
  harness.CheckCase(
      Case(
          num_stages=3,
          num_microbatches=5,
          circular_repeat=2,
          batch=10,
          kwargs=True,
          kwargs_no_batch=True), mode)


@pytest.mark.parametrize('mode', MODES)
def test_premicrobatched_inputs(mode):
  # Neither num_microbatches nor microbatch_size: inputs are [M, mb, ...].
  harness.CheckCase(
      Case(
          num_stages=2,
          num_microbatches=3,
          premicrobatched=True,
          circular_repeat=2,
          batch=6), mode)


@pytest.mark.parametrize('mode', MODES)
@pytest.mark.parametrize('body', ['dense', 'stage_parallel'])
def test_premicrobatched_inputs_unrolled(body, mode):
  # As the GShard builders evaluate: [M, mb, ...] inputs and per-example
  # kwargs, the layers run one after another (eval_only in eval, always).
  harness.CheckCase(
      Case(
          body=body,
          num_stages=2,
          num_microbatches=3,
          premicrobatched=True,
          circular_repeat=2,
          batch=6,
          kwargs=True,
          unroll='always'), mode)


def test_premicrobatched_inputs_unrolled_need_a_shared_leading_dim():
  p = harness.Case(num_stages=2, premicrobatched=True,
                   unroll='always').Params()
  with tf.Graph().as_default():
    layer = p.Instantiate()
    with pytest.raises(ValueError, match=r'taken as already microbatched, '
                       r'\[M, ...\] with one static M; got shapes '
                       r'\(3, 2, 4\), \(2, 2, 4\).*Set num_microbatches'):
      layer.FProp(layer.theta, tf.zeros([3, 2, 4]), scale=tf.zeros([2, 2, 4]))


# In graph mode every pair of storing policy, body and shape (9 of the
# product's 18); under jit each policy with each body once, the shapes
# rotating (XLA compiles the stored stacks per body, not per shape).
_REMAT_BODIES = ('dense', 'multi', 'stage_parallel')
_REMAT_SHAPES = ((3, 4, 2), (4, 6, 1), (2, 5, 1))
_REMAT_CASES = (
    covering.Pairwise([(policy, body, shape, 'graph')
                       for policy in ('save_dots', 'save_all')
                       for body in _REMAT_BODIES for shape in _REMAT_SHAPES],
                      (lambda c: c[0], lambda c: c[1], lambda c: c[2])) +
    [(policy, body, _REMAT_SHAPES[(i + j) % len(_REMAT_SHAPES)], 'jit')
     for i, policy in enumerate(('save_dots', 'save_all'))
     for j, body in enumerate(_REMAT_BODIES)])


@pytest.mark.parametrize(
    'policy,body,shape,mode', _REMAT_CASES,
    ids=['{}-{}-{}-{}-{}-{}'.format(p, b, *shape, mode)
         for p, b, shape, mode in _REMAT_CASES])
def test_remat_policies(policy, body, shape, mode):
  s, m, r = shape
  harness.CheckCase(
      Case(body=body, num_stages=s, num_microbatches=m, circular_repeat=r,
           batch=2 * m, remat_policy=policy), mode)


@pytest.mark.parametrize('mode', MODES)
def test_store_body_intermediates_is_save_all(mode):
  p = Case(num_stages=3, num_microbatches=4, circular_repeat=2, batch=8,
           store_body_intermediates=True).Params()
  with tf.Graph().as_default():
    assert p.Instantiate().params.remat_policy == 'save_all'
  harness.CheckCase(
      Case(num_stages=3, num_microbatches=4, circular_repeat=2, batch=8,
           store_body_intermediates=True), mode)


@pytest.mark.parametrize('mode', MODES)
@pytest.mark.parametrize('body,per_stage', _BODIES)
def test_unroll_always(body, per_stage, mode):
  harness.CheckCase(
      Case(
          body=body,
          per_stage_vars=per_stage,
          num_stages=3,
          num_microbatches=4,
          circular_repeat=2,
          batch=8,
          unroll='always'), mode)


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(pytest.main([__file__]))
