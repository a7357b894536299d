"""Checks of PipelinedLayer params: every bad value or combination is a
ValueError naming the param, the value (and its type) and the fix, raised
before anything is built."""

import dataclasses
from typing import Optional

import numpy as np

from gpipe.loops import remat
from gpipe import microbatch
from gpipe import schedule as schedule_lib

# Params that take one of a few strings.
_CHOICES = {
    'unroll': ('never', 'eval_only', 'always'),
    'vectorize_stages': ('auto', 'always', 'never'),
    'compile_loops': ('auto', 'never'),
    'remat_policy': tuple(remat.POLICIES) + (None,),
    'backward_schedule': ('reverse', '1f1b'),
    'aux_loss_microbatch_accumulation': ('mean', 'sum'),
}
_BOOL_PARAMS = ('shard_stages_1d', 'per_stage_vars',
                'store_body_intermediates', 'stream_io')
_INT_PARAMS = ('num_stages', 'circular_repeat', 'num_microbatches',
               'microbatch_size', 'pipeline_stage_mesh_dim',
               'ring_split_mesh_dim')


def Check(p):
  """Raises ValueError naming the parameter for every bad combination."""
  for name in ('num_stages', 'circular_repeat'):
    value = p.Get(name)
    if not schedule_lib.IsInteger(value) or value < 1:
      raise ValueError(f'{name} must be an integer >= 1, got {value!r} '
                       f'({type(value).__name__}).')
  for name in _BOOL_PARAMS:
    value = p.Get(name)
    if not isinstance(value, (bool, np.bool_)):
      raise ValueError(f'{name} must be True or False, got {value!r} '
                       f'({type(value).__name__}).')
  for name, none_means in (('layer_by_layer', "the program's default"),
                           ('skip_bubbles', 'where it pays')):
    value = p.Get(name)
    if not isinstance(value, (bool, np.bool_, type(None))):
      raise ValueError(f'{name} must be True, False or None ({none_means}),'
                       f' got {value!r} ({type(value).__name__}).')
  for name in ('pipeline_stage_mesh_dim', 'ring_split_mesh_dim'):
    value = p.Get(name)
    if value is not None and not schedule_lib.IsInteger(value):
      raise ValueError(f'{name} must be None or an integer, got {value!r} '
                       f'({type(value).__name__}).')
  for name, choices in _CHOICES.items():
    if p.Get(name) not in choices:
      raise ValueError(f'{name} must be one of {choices}, got '
                       f'{p.Get(name)!r}.')
  if p.store_body_intermediates and p.remat_policy not in (None, 'recompute',
                                                          'save_all'):
    raise ValueError(
        'store_body_intermediates=True means remat_policy=\'save_all\'; it '
        f'contradicts remat_policy={p.remat_policy!r}. Set only '
        'remat_policy.')
  if p.backward_schedule == '1f1b' and p.skip_bubbles:
    raise ValueError(
        "skip_bubbles=True and backward_schedule='1f1b' do not combine: "
        'skip_bubbles narrows the reverse schedule\'s loops on one device, '
        "while the 1f1b gradient loop runs every stage in each of its "
        "phases. Set skip_bubbles=False (1f1b's phases already leave out "
        "the waves no stage needs) or backward_schedule='reverse'.")
  if (p.single_stage_body is None) == (p.stage_parallel_body is None):
    raise ValueError(
        'Set exactly one of single_stage_body and stage_parallel_body; got '
        f'single_stage_body={"set" if p.single_stage_body else None}, '
        f'stage_parallel_body={"set" if p.stage_parallel_body else None}.')
  if p.per_stage_vars and p.stage_parallel_body is not None:
    raise ValueError(
        'per_stage_vars=True needs single_stage_body; a stage_parallel_body '
        'defines its own stacked variables. Unset per_stage_vars or use '
        'single_stage_body.')
  microbatch.CheckMicrobatchParams(p.num_microbatches, p.microbatch_size)
  _CheckMesh(p)
  _CheckRingSplit(p)


def _CheckMesh(p):
  """The stage placement's params."""
  if p.shard_stages_1d and p.pipeline_stage_mesh_dim is not None:
    raise ValueError(
        'Set at most one of shard_stages_1d and pipeline_stage_mesh_dim; got '
        f'shard_stages_1d=True and pipeline_stage_mesh_dim='
        f'{p.pipeline_stage_mesh_dim}.')
  if p.pipeline_stage_mesh_dim is not None:
    if p.device_mesh is None:
      raise ValueError(
          f'pipeline_stage_mesh_dim={p.pipeline_stage_mesh_dim} needs '
          'device_mesh to be set.')
    mesh = np.asarray(p.device_mesh)
    if not 0 <= p.pipeline_stage_mesh_dim < mesh.ndim:
      raise ValueError(
          f'pipeline_stage_mesh_dim={p.pipeline_stage_mesh_dim} is not an '
          f'axis of device_mesh with shape {mesh.shape}.')
    if mesh.shape[p.pipeline_stage_mesh_dim] != p.num_stages:
      raise ValueError(
          f'device_mesh axis {p.pipeline_stage_mesh_dim} has '
          f'{mesh.shape[p.pipeline_stage_mesh_dim]} devices but num_stages='
          f'{p.num_stages}; they must be equal.')
    if p.num_stages == 1 and p.circular_repeat > 1:
      raise ValueError(
          f'device_mesh axis {p.pipeline_stage_mesh_dim} (the stages) has 1 '
          f'device, so there is no pipeline, but circular_repeat='
          f'{p.circular_repeat}; set circular_repeat=1 and give the one '
          f'stage {p.circular_repeat} x its blocks.')


def _CheckRingSplit(p):
  """ring_split_mesh_dim: another axis of the stages' mesh, under 1f1b."""
  axis = p.ring_split_mesh_dim
  if axis is None:
    return
  if p.backward_schedule != '1f1b' or p.pipeline_stage_mesh_dim is None:
    raise ValueError(
        f'ring_split_mesh_dim={axis} splits the rings of '
        "backward_schedule='1f1b' over an axis of the stages' device_mesh; "
        f'got backward_schedule={p.backward_schedule!r} and '
        f'pipeline_stage_mesh_dim={p.pipeline_stage_mesh_dim}. Set both, '
        'or leave ring_split_mesh_dim None.')
  mesh = np.asarray(p.device_mesh)
  if not 0 <= axis < mesh.ndim or axis == p.pipeline_stage_mesh_dim:
    raise ValueError(
        f'ring_split_mesh_dim={axis} must be an axis of device_mesh (shape '
        f'{mesh.shape}) other than pipeline_stage_mesh_dim='
        f'{p.pipeline_stage_mesh_dim}.')


def Normalize(p):
  """NumPy integers and bools (accepted by Check) as plain Python values."""
  for name in _INT_PARAMS:
    if p.Get(name) is not None:
      p.Set(**{name: int(p.Get(name))})
  for name in _BOOL_PARAMS:
    p.Set(**{name: bool(p.Get(name))})
  if p.skip_bubbles is not None:
    p.Set(skip_bubbles=bool(p.skip_bubbles))
  if p.store_body_intermediates:
    p.Set(remat_policy='save_all')


def RematPolicy(p):
  """The partitioned pipeline loop's remat policy (what `gpipe.plan`
  plans): the one params ask for (store_body_intermediates: save_all), by
  default recompute. On one device the loop decides for None
  (gpipe.pipeline.loop_choices.ChosenRematPolicy)."""
  return AskedRematPolicy(p) or 'recompute'


def LoopRematPolicy(p, do_eval):
  """What the pipeline's loop is asked to store: the policy the params ask
  for; else in eval 'recompute', which stores nothing (no backward pass
  reads what another policy would); else None, for the loop to decide
  (gpipe.pipeline.loop_choices.ChosenRematPolicy)."""
  asked = AskedRematPolicy(p)
  if asked is None and do_eval:
    return 'recompute'
  return asked


def LayerByLayerRematPolicy(p):
  """Layer by layer (gpipe.pipeline.layer_by_layer): the one params ask
  for, by default save_dots. Each layer's loop iteration runs on the whole
  batch, so save_dots keeps the dots' outputs of every layer for the whole
  batch, as the plain stack does (which keeps every activation), and the
  backward pass recomputes only the elementwise rest, at most the
  recomputing step's time for every body measured
  (docs/benchmarks.md#measured-behind-the-codes-choices)."""
  return AskedRematPolicy(p) or 'save_dots'


def AskedRematPolicy(p):
  """The remat policy the params ask for, or None (each loop's default)."""
  return 'save_all' if p.store_body_intermediates else p.remat_policy


def CheckIndex(name, value, bound):
  if isinstance(value, (int, np.integer)) and not 0 <= value < bound:
    raise ValueError(f'{name}={value} is out of range [0, {bound}).')


@dataclasses.dataclass(frozen=True)
class CheckedParams:
  """What gpipe.layers.ValidateParams checked, resolved.

  num_microbatches: from the batch size when one is given (what the layer
  will split it into), else the params' own (None if only microbatch_size
  is set); microbatch_size: examples per microbatch, None when not known (no
  batch size and only num_microbatches set, or neither param set: the
  inputs then come as [M, ...]). num_iterations and bubble_fraction are
  gpipe.schedule.Schedule's for (num_stages, num_microbatches,
  circular_repeat); None without num_microbatches.
  """
  num_stages: int
  circular_repeat: int
  num_microbatches: Optional[int]
  microbatch_size: Optional[int]
  num_iterations: Optional[int]
  bubble_fraction: Optional[float]

  def __str__(self):
    """'4 stages x 2 repeats, 16 microbatches of 4: 35 iterations, bubble
    0.086'."""
    text = _Count(self.num_stages, 'stage') + (
        f' x {self.circular_repeat} repeats' if self.circular_repeat > 1
        else '')
    size = (f' of {self.microbatch_size}'
            if self.microbatch_size is not None else '')
    if self.num_microbatches is None and self.microbatch_size is None:
      return (f'{text}, inputs read as [M, ...] microbatches (the schedule '
              'comes with M)')
    if self.num_microbatches is None:
      return (f'{text}, microbatches{size} (their number, and so the '
              'schedule, comes with the batch size)')
    return (f'{text}, {_Count(self.num_microbatches, "microbatch")}{size}: '
            f'{_Count(self.num_iterations, "iteration")}, bubble '
            f'{self.bubble_fraction:.3f}')


def Checked(p, batch_size=None):
  """The CheckedParams of params that passed Check (ValueError if
  batch_size does not split into their microbatches)."""
  num_microbatches, size = p.num_microbatches, p.microbatch_size
  if batch_size is not None:
    num_microbatches, split = microbatch.ResolveNumMicrobatches(
        batch_size, p.num_microbatches, p.microbatch_size)
    size = batch_size // num_microbatches if split else None
  schedule = (None if num_microbatches is None else
              schedule_lib.Schedule.ForLayer(p, num_microbatches))
  return CheckedParams(
      num_stages=int(p.num_stages),
      circular_repeat=int(p.circular_repeat),
      num_microbatches=None if schedule is None else schedule.num_microbatches,
      microbatch_size=None if size is None else int(size),
      num_iterations=None if schedule is None else schedule.num_iterations,
      bubble_fraction=None if schedule is None else schedule.bubble_fraction)


def _Count(n, noun):
  """'1 stage', '4 stages', '2 microbatches'."""
  plural = 'es' if noun.endswith('ch') else 's'
  return f'{n} {noun}' + ('' if n == 1 else plural)
