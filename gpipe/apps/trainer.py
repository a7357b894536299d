"""Graph-mode training of a registered Lingvo model, with checkpoints.

A small driver around Lingvo's own SingleTaskModel (FPropDefaultTheta +
BProp with the task's learner): enough to train a pipelined model from one
command on CPU, resume it from a checkpoint, and check before training that
the pipelined model computes what the same model computes unpipelined.

    cfg = model_registry.GetParams('lm.CopyLMSmall', 'Train')
    print(CompareWithUnrolled(cfg).Describe())
    history = Train(cfg, steps=200, logdir='/tmp/copy_lm')

Training stops at global step `steps`; a later call with a larger `steps`
and the same logdir restores the latest checkpoint and continues.
"""

import dataclasses
import os
import sys
import time

import numpy as np
import tensorflow as tf

from gpipe.lingvo_support import flags_and_seeds
from gpipe import microbatch
from gpipe import schedule as schedule_lib
from gpipe.schedule import plot as schedule_plot
from lingvo.core import cluster_factory

_CHECKPOINT_NAME = 'ckpt'


@dataclasses.dataclass
class TrainGraph:
  """A built training graph: run `train_op` to take one step."""
  graph: tf.Graph
  task: object
  loss: tf.Tensor
  accuracy: tf.Tensor
  train_op: tf.Operation
  global_step: tf.Variable
  saver: tf.compat.v1.train.Saver
  metrics: dict  # {name: value} of every scalar the task reports


def BuildTrainGraph(cfg, graph_seed=1):
  """Builds Lingvo's FProp + BProp graph of model params `cfg`."""
  flags_and_seeds.EnsureFlagsParsed()
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.random.set_random_seed(graph_seed)
    model = cfg.Instantiate()
    model.ConstructFPropBPropGraph()
    task = model.GetTask()
    metrics = task.eval_metrics
    accuracy = metrics['accuracy'][0] if 'accuracy' in metrics else tf.constant(
        float('nan'))
    saver = tf.compat.v1.train.Saver(max_to_keep=3)
    return TrainGraph(graph=graph, task=task, loss=task.loss,
                      accuracy=accuracy, train_op=task.train_op,
                      global_step=model.global_step, saver=saver,
                      metrics={k: v for k, (v, _) in metrics.items()})


@dataclasses.dataclass
class StepResult:
  step: int  # the global step the loss was computed at
  loss: float
  accuracy: float
  seconds: float


def Train(cfg, steps, logdir=None, progress=None, on_start=None,
          save_every=None, summary_every=10, seconds=None):
  """Trains until global step `steps`; returns the StepResults of this run.

  Args:
    cfg: SingleTaskModel params (e.g. from model_registry.GetParams).
    steps: the global step to stop at.
    logdir: checkpoint and TensorBoard directory; the latest checkpoint
      there is restored first, and one is written at the end (and every
      `save_every` steps).
    progress: a Progress to report to, or None for none.
    on_start: called as on_start(session, train_graph) after initialization
      or restore, before the first step.
    save_every: steps between checkpoints (default: only at the end).
    summary_every: steps between TensorBoard scalars in logdir (every
      metric the task reports, e.g. the pipeline's `<name>/stage_<i>`, and
      `step_time_seconds`); the run also writes its pipeline schedule as
      an image (see ScheduleImage).
    seconds: also stop after the step that ends this long after the first
      step began (None: no limit).

  Returns:
    A list of StepResult, one per step taken.
  """
  tg = BuildTrainGraph(cfg)
  history = []
  with tg.graph.as_default(), tf.compat.v1.Session(graph=tg.graph) as sess:
    start_step = _InitOrRestore(sess, tg, logdir)
    events = _Events(logdir) if logdir else None
    if events:
      events.writer.add_summary(ScheduleImage(cfg), start_step)
    if on_start:
      on_start(sess, tg)
    if progress:
      progress.Start(start_step, steps)
    deadline = None if seconds is None else time.time() + seconds
    for step in range(start_step, steps):
      if deadline is not None and time.time() > deadline:
        break
      began = time.time()
      loss, accuracy, metrics, _ = sess.run(
          [tg.loss, tg.accuracy, tg.metrics, tg.train_op])
      result = StepResult(step, float(loss), float(accuracy),
                          time.time() - began)
      history.append(result)
      if progress:
        progress.Update(result)
      # Labelled, as Lingvo's trainer labels them, with the global step
      # after the update (the step a checkpoint taken now would have).
      done = step + 1
      if events and (step == start_step or done % summary_every == 0 or
                     done == steps):
        events.Write(done, metrics, result.seconds)
      if logdir and save_every and (step + 1) % save_every == 0:
        _Save(sess, tg, logdir)
    if progress:
      progress.Finish()
    if events:
      events.writer.close()
    if logdir and history:
      _Save(sess, tg, logdir)
  return history


class _Events:
  """Writes a training run's TensorBoard scalars into its logdir."""

  def __init__(self, logdir):
    self.writer = tf.compat.v1.summary.FileWriter(logdir)

  def Write(self, step, metrics, step_seconds):
    values = dict(metrics, step_time_seconds=step_seconds)
    self.writer.add_summary(tf.compat.v1.Summary(value=[
        tf.compat.v1.Summary.Value(tag=k, simple_value=float(v))
        for k, v in sorted(values.items())]), step)
    self.writer.flush()


def StackSchedule(cfg):
  """The schedule of the task's pipelined stack for one training batch."""
  sp = cfg.task.stack
  num_microbatches, _ = microbatch.ResolveNumMicrobatches(
      cfg.input.batch_size, sp.num_microbatches, sp.microbatch_size)
  return schedule_lib.Schedule.ForLayer(sp, num_microbatches)


def ScheduleImage(cfg):
  """The stack's schedule diagram as a TensorBoard image summary."""
  return schedule_plot.ImageSummary(StackSchedule(cfg))


@dataclasses.dataclass
class DecodeResult:
  """Greedy copies of held-out prompts, decoded through the pipeline."""
  num_sequences: int
  token_accuracy: float  # decoded tokens equal to the targets
  exact_copies: float  # sequences copied without an error
  agreement: float  # decoded tokens equal to full-sequence greedy decoding
  largest_margin_where_different: float  # top-2 logit gap; ~0 is a tie
  seconds: float

  def Agrees(self, tie=1e-4):
    """Incremental and full-sequence greedy decoding pick the same tokens
    (or differ only where two logits tie)."""
    return self.largest_margin_where_different <= tie

  def Describe(self):
    return (f'decoded {self.num_sequences} held-out copies through the '
            f'pipeline: token accuracy {self.token_accuracy:.3f}, exact '
            f'copies {self.exact_copies:.3f}; equal to full-sequence greedy '
            f'decoding: {self.agreement:.3f} of tokens [{self.seconds:.1f} s]')


def DecodeHeldOut(cfg, logdir):
  """Decodes the held-out set (cfg.input: every one of its held_out_batches)
  with the checkpoint in logdir.

  Incremental decoding (the task's Decode: one ExtendStep per position
  through the pipelined stack, per-stage caches) and, as its check, the
  argmax of one causal full-sequence FProp over the decoded tokens (the
  task's FullSequenceGreedyCheck): equal at every position iff the tokens
  are the model's full-sequence greedy decoding.
  """
  flags_and_seeds.EnsureFlagsParsed()
  latest = tf.train.latest_checkpoint(logdir)
  if not latest:
    raise ValueError(f'No checkpoint in {logdir} to decode with.')
  graph = tf.Graph()
  # In eval mode, as Lingvo's decoder job builds it: no dropout, which would
  # draw other masks in the incremental and the full-sequence decoding.
  with graph.as_default(), cluster_factory.SetEval(True):
    model = cfg.Instantiate()
    task = model.GetTask()
    batch = task.input_generator.GetPreprocessedInputBatch()
    out = task.Decode(batch)
    full, margin = task.FullSequenceGreedyCheck(task.theta, out.prompts,
                                                out.decoded)
    saver = tf.compat.v1.train.Saver()  # weights and global step
    with tf.compat.v1.Session(graph=graph) as sess:
      saver.restore(sess, latest)
      sess.run(tf.compat.v1.local_variables_initializer())  # held-out reader
      began = time.time()
      runs = [sess.run([out.decoded, out.targets, full, margin])
              for _ in range(max(1, cfg.input.held_out_batches))]
  decoded, targets, full, margin = (np.concatenate(x) for x in zip(*runs))
  correct = decoded == targets
  differ = decoded != full
  return DecodeResult(
      num_sequences=len(decoded), token_accuracy=float(correct.mean()),
      exact_copies=float(correct.all(axis=1).mean()),
      agreement=float(1 - differ.mean()),
      largest_margin_where_different=float(
          margin[differ].max()) if differ.any() else 0.0,
      seconds=time.time() - began)


def InitialValues(sess, task):
  """{variable name: value} of a task's variables in a session."""
  variables = task.vars.Flatten()
  return dict(zip([v.name for v in variables], sess.run(variables)))


def LoadValues(sess, variables, values):
  """Sets each variable to values[its name] in one session run.

  (Variable.load runs the session once per variable, each run a new graph
  for the session to optimize when Grappler is on.)"""
  holders = [tf.compat.v1.placeholder(v.dtype.base_dtype, v.shape)
             for v in variables]
  sess.run([v.assign(h) for v, h in zip(variables, holders)],
           {h: values[v.name] for v, h in zip(variables, holders)})


def _InitOrRestore(sess, tg, logdir):
  latest = tf.train.latest_checkpoint(logdir) if logdir else None
  if latest:
    tg.saver.restore(sess, latest)
  else:
    sess.run(tf.compat.v1.global_variables_initializer())
  return int(sess.run(tg.global_step))


def CheckpointStep(logdir):
  """The global step of the latest checkpoint in logdir, or 0 if none."""
  latest = tf.train.latest_checkpoint(logdir) if logdir else None
  return int(latest.rpartition('-')[2]) if latest else 0


def _Save(sess, tg, logdir):
  os.makedirs(logdir, exist_ok=True)
  tg.saver.save(sess, os.path.join(logdir, _CHECKPOINT_NAME),
                global_step=tg.global_step)


@dataclasses.dataclass
class Comparison:
  """Loss and gradients of the pipelined model vs the same model unrolled."""
  loss_pipelined: float
  loss_unrolled: float
  max_abs_grad_diff: float
  max_rel_grad_diff: float  # |diff| / max(|unrolled|, 1), largest
  num_variables: int

  @property
  def loss_diff(self):
    return abs(self.loss_pipelined - self.loss_unrolled)

  def Matches(self, atol=1e-5, rtol=1e-5):
    return (self.loss_diff <= atol + rtol * abs(self.loss_unrolled) and
            self.max_rel_grad_diff <= max(atol, rtol))

  def Describe(self):
    return (f'loss pipelined {self.loss_pipelined:.6f}, unrolled '
            f'{self.loss_unrolled:.6f} (|diff| {self.loss_diff:.2e}); '
            f'gradients of {self.num_variables} variables: largest |diff| '
            f'{self.max_abs_grad_diff:.2e}, relative '
            f'{self.max_rel_grad_diff:.2e}')


def CompareWithUnrolled(cfg, values=None):
  """Loss and gradients at step 0, pipelined vs `unroll='always'`.

  Both models are built from `cfg` with the task's pipelined stack (child
  `stack`) set to unroll='never' and 'always' respectively, and with
  dropout off: a pipelined run draws dropout masks per microbatch, so they
  legitimately differ from a whole-batch unrolled run. Both see the same
  weights (`values`, {variable name: value}, or the first model's
  initialization) and the same input batch.
  """
  results = {}
  for unroll in ('never', 'always'):
    c = cfg.Copy()
    c.task = WithoutDropout(c.task)
    c.task.stack.unroll = unroll
    loss, grads, values = _LossAndGradients(c, values)
    results[unroll] = (loss, grads)
  (loss_p, grads_p), (loss_u, grads_u) = results['never'], results['always']
  abs_diff = rel_diff = 0.0
  for name, ref in grads_u.items():
    err = np.abs(grads_p[name] - ref)
    abs_diff = max(abs_diff, float(err.max()))
    rel_diff = max(rel_diff, float((err / np.maximum(np.abs(ref), 1)).max()))
  return Comparison(float(loss_p), float(loss_u), abs_diff, rel_diff,
                    len(grads_u))


def _LossAndGradients(cfg, values):
  """(loss, {name: gradient}, {name: value}) at step 0 of a fresh model."""
  flags_and_seeds.EnsureFlagsParsed()
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.random.set_random_seed(1)
    model = cfg.Instantiate()
    task = model.GetTask()
    metrics, _ = task.FPropDefaultTheta()
    loss = metrics['loss'][0]
    variables = task.vars.Flatten()
    # Embedding gradients come as IndexedSlices; compare them densely.
    grads = [tf.convert_to_tensor(g) for g in tf.gradients(loss, variables)]
    with tf.compat.v1.Session(graph=graph) as sess:
      sess.run(tf.compat.v1.global_variables_initializer())
      if values is not None:
        LoadValues(sess, variables, values)
      else:
        values = InitialValues(sess, task)
      loss_value, grad_values = sess.run([loss, grads])
  names = [v.name for v in variables]
  return loss_value, dict(zip(names, grad_values)), values


def WithoutDropout(p):
  """A copy of params `p` with every dropout probability 0 (keep_prob 1)."""
  p = p.Copy()
  _ZeroDropout(p)
  return p


def _ZeroDropout(p):
  for name, value in p.IterParams():
    if hasattr(value, 'IterParams'):
      _ZeroDropout(value)
    elif isinstance(value, list):
      for item in value:
        if hasattr(item, 'IterParams'):
          _ZeroDropout(item)
    elif name.endswith('dropout_prob') and isinstance(value, float):
      p.Set(**{name: 0.0})
    elif name == 'keep_prob' and isinstance(value, float):
      p.Set(keep_prob=1.0)


class Progress:
  """A one-line progress bar: step, loss, accuracy and step time.

  On a terminal the line is redrawn in place; otherwise (logs, CI) a line is
  printed every `every` steps.
  """

  def __init__(self, stream=None, width=30, every=25):
    self._stream = stream or sys.stdout
    self._width = width
    self._every = every
    self._tty = self._stream.isatty()

  def Start(self, start_step, steps):
    self._start, self._steps = start_step, steps
    self._times = []

  def Update(self, result):
    self._times.append(result.seconds)
    done = result.step + 1
    recent = self._times[-20:]
    step_time = sum(recent) / len(recent)
    span = max(self._steps - self._start, 1)
    filled = int(self._width * (done - self._start) / span)
    bar = '#' * filled + '.' * (self._width - filled)
    line = (f'step {done:>5}/{self._steps} [{bar}] loss {result.loss:.4f} '
            f'acc {result.accuracy:.3f} {step_time * 1000:.0f} ms/step')
    if self._tty:
      self._stream.write('\r' + line)
    elif done == self._start + 1 or done % self._every == 0 or (
        done == self._steps):
      self._stream.write(line + '\n')
    self._stream.flush()

  def Finish(self):
    if self._tty:
      self._stream.write('\n')
      self._stream.flush()
