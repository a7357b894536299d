"""remat_policy=None in the pipeline's loop: what it stores, where.

The default keeps the dots' outputs (save_dots) on one device, with the
reverse schedule, for a body of at least
loop_choices.MIN_FLOPS_PER_CALL_TO_SAVE_DOTS a microbatch, and recomputes
everywhere else (partitioned, 1f1b, small bodies). A policy asked for is
what runs. The decision is checked as a table, then on a layer whose dense
body is above the threshold: its default step stores the dots and equals
the harness's references (NumPy and a plain TF loop) in graph mode and
under jit; the same layer on smaller microbatches recomputes, and so does
it in eval (do_eval), where no backward pass reads what it would store.
"""

import types

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe import schedule
from gpipe.pipeline import loop_choices
from gpipe.pipeline import stage_runners
from lingvo.core import cluster_factory
from tests import close
from tests import pipeline_harness as harness

ONE_DEVICE = stage_runners.OneByOne()
PARTITIONED = stage_runners.InManualRegion((np.arange(4), 0))


def _Spec(remat_policy, runner, backward_schedule='reverse'):
  return types.SimpleNamespace(
      schedule=schedule.Schedule(4, 4), remat_policy=remat_policy,
      runner=runner, backward_schedule=backward_schedule)


@pytest.mark.parametrize('asked,runner,backward,flops,policy', [
    (None, ONE_DEVICE, 'reverse', 2e6, 'save_dots'),
    (None, ONE_DEVICE, 'reverse', 2e6 - 1, 'recompute'),
    (None, ONE_DEVICE, '1f1b', 1e9, 'recompute'),
    (None, PARTITIONED, 'reverse', 1e9, 'recompute'),
    ('recompute', ONE_DEVICE, 'reverse', 1e9, 'recompute'),
    ('save_all', PARTITIONED, 'reverse', 1, 'save_all'),
    ('save_dots', ONE_DEVICE, '1f1b', 1, 'save_dots'),
])
def test_none_saves_dots_on_one_device_for_a_compute_bound_body(
    monkeypatch, asked, runner, backward, flops, policy):
  assert loop_choices.MIN_FLOPS_PER_CALL_TO_SAVE_DOTS == 2e6
  monkeypatch.setattr(loop_choices, 'CallFlops', lambda *_: flops)
  assert loop_choices.ChosenRematPolicy(
      _Spec(asked, runner, backward), (), ()) == policy


@pytest.mark.parametrize('mode', ['graph', 'jit'])
def test_a_compute_bound_body_saves_its_dots_and_equals_the_reference(
    monkeypatch, mode):
  """A 256-wide dense body on 4 x 4 rows a microbatch: 2 x 16 x 256 x 256
  = 2.1 MFLOPs a call, above the threshold."""
  used = harness.RecordRematPolicies(monkeypatch)
  case = harness.Case(num_stages=2, num_microbatches=2, batch=8,
                      example_shape=(4, 256))
  # Sums of 256 products: under jit XLA adds them in another order than
  # the reference's TF kernels (errors of 1.6e-5 on entries of 0.16).
  harness.CheckCase(case, mode, close.FLOAT32_AT_SCALE)
  assert used and set(used) == {'save_dots'}, used


def test_a_body_below_the_threshold_recomputes(monkeypatch):
  """The same body on 2 x 4 rows a microbatch: 1.05 MFLOPs."""
  used = harness.RecordRematPolicies(monkeypatch)
  harness.CheckCase(harness.Case(num_stages=2, num_microbatches=2, batch=4,
                                 example_shape=(4, 256)), 'graph')
  assert used and set(used) == {'recompute'}, used


def test_in_eval_the_loop_stores_nothing(monkeypatch):
  """do_eval (Lingvo's eval and decode jobs) with unroll='never': the same
  compute-bound body recomputes, as nothing reads what it would store."""
  used = harness.RecordRematPolicies(monkeypatch)
  case = harness.Case(num_stages=2, num_microbatches=2, batch=8,
                      example_shape=(4, 256))
  with tf.Graph().as_default(), cluster_factory.SetEval(True):
    layer = case.Params().Instantiate()
    layer.FProp(layer.theta, tf.ones([8, 4, 256]))
  assert used == ['recompute']
