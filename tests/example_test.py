"""The README's use snippet and the examples run as a user runs them.

examples/my_model.py runs as a script in a process of its own (as the
README shows); what it prints is checked against numbers derived here from
its model's sizes, and against the output the README shows. The README's
snippet is taken from the README itself, run, and its output compared with
its 8 logical layers applied one after another. examples/my_task.py's task
is compared with its layers run in turn, computed here.
"""

import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe import check_partitioning
from gpipe import layers
from lingvo.core import py_utils
from tests import docs_test

_ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.runs_long
def test_my_model_example_runs_checks_partitions_and_plans():
  pytest.importorskip('jax')
  env = dict(os.environ)
  env.pop('TF_CPP_MIN_LOG_LEVEL', None)  # as in a user's shell
  run = subprocess.run([sys.executable, 'examples/my_model.py'], cwd=_ROOT,
                       env=env, capture_output=True, text=True, timeout=600,
                       check=False)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  assert run.stderr == ''  # the example keeps the libraries quiet
  out = run.stdout
  assert out.strip().endswith('OK')
  # Output, input gradient and one gradient per weight (3 layers of 2).
  differences = re.findall(r'largest \|difference\| (\S+)', out)
  assert len(differences) == 2 + 6, out
  assert max(float(d) for d in differences) <= 1e-5, differences
  # Per logical layer: LayerNorm (scale, bias) of 8, FC 8 -> 32, FC 32 -> 8.
  floats = 2 * 8 + (8 * 32 + 32) + (32 * 8 + 8)
  total = 2 * 2 * floats * 4  # 2 stages x 2 repeats, float32
  assert f'Weight bytes per device: {total // 2} of {total} ' in out
  assert 'Weights gathered or transposed: none' in out
  assert '3. Planned for 2 TPU v5e chips' in out
  # What the README shows it print (docs_test runs the README's other
  # commands; this one runs here).
  shown = [c.shown for c in docs_test.Commands((_ROOT / 'README.md').read_text())
           if c.text == '.venv/bin/python examples/my_model.py']
  assert len(shown) == 1 and shown[0], shown
  assert docs_test.ShownOutputMatches(shown[0], out.splitlines()), out


def test_my_model_params_load_by_module_and_by_file(monkeypatch):
  # Loading the file puts its directory on sys.path and the module in
  # sys.modules, as for a script: both are restored after the test.
  monkeypatch.setattr(sys, 'path', list(sys.path))
  monkeypatch.setitem(sys.modules, 'my_model', None)
  monkeypatch.delitem(sys.modules, 'my_model')
  by_module = check_partitioning.LoadParams('examples.my_model.PipelineParams')
  by_file = check_partitioning.LoadParams(
      str(_ROOT / 'examples' / 'my_model.py') + ':PipelineParams')
  for p in (by_module, by_file):
    assert issubclass(p.cls, layers.PipelinedLayer)
    assert (p.num_stages, p.circular_repeat) == (2, 2)
    assert p.single_stage_body.cls.__name__ == 'ResidualMlp'


def _ReadmeSnippet():
  """The first Python block of the README's Use section."""
  readme = (_ROOT / 'README.md').read_text()
  use = readme[readme.index('\n## Use\n'):]
  return re.search(r'```python\n(.*?)```', use, re.S).group(1)


def test_readme_use_snippet_runs_as_written():
  scope = {}
  code = compile(_ReadmeSnippet(), 'README.md', 'exec')
  exec(code, scope)  # pylint: disable=exec-used
  stack, x, paddings = scope['stack'], scope['x'], scope['paddings']
  p = stack.params

  @tf.function(autograph=False)
  def LayersInTurn(h):
    for r in range(p.circular_repeat):
      for s in range(p.num_stages):
        h = stack.body.FProp(stack.layer_theta(stack.theta, r, s), h,
                             paddings)
    return h

  y = scope['y'].numpy()
  assert y.shape == (64, 8)
  np.testing.assert_allclose(y, LayersInTurn(x).numpy(), rtol=1e-5,
                             atol=1e-5)


def test_my_task_equals_its_layers_run_in_turn():
  """examples/my_task.py's task, pipelined, against the same task computed
  here: its input projection, the 8 logical layers applied one after
  another on the whole batch (each on its own weights), the output
  projection and the mean squared error; the loss and every gradient."""
  from examples import my_task  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(5)
  x = rng.normal(size=[32, my_task.DIM]).astype(np.float32)
  y = rng.normal(size=[32, my_task.DIM]).astype(np.float32)
  with tf.Graph().as_default():
    tf.random.set_seed(2)
    task = my_task.MyRegression().Task().Instantiate()
    batch = py_utils.NestedMap(x=tf.constant(x), y=tf.constant(y))
    metrics, _ = task.FPropDefaultTheta(batch)
    theta, stack = task.theta, task.stack
    h = task.proj_in.FProp(theta.proj_in, batch.x)
    for r in range(stack.params.circular_repeat):
      for s in range(stack.params.num_stages):
        h = stack.body.FProp(stack.layer_theta(theta.stack, r, s), h)
    out = task.proj_out.FProp(theta.proj_out, h)
    reference = tf.reduce_mean(tf.square(out - batch.y))
    variables = task.vars.Flatten()
    grads = tf.gradients(metrics['loss'][0], variables)
    reference_grads = tf.gradients(reference, variables)
    with tf.compat.v1.Session() as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      got, want = sess.run(([metrics['loss'][0]] + grads,
                            [reference] + reference_grads))
  assert len(got) == 1 + 4 + 6  # the loss; 2 projections; 3 body layers
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
