"""Non-trainable variables of a pipelined body, carried through the loop.

A body may keep state in non-trainable variables (batch-norm moving
statistics, a step counter) and update them in FProp with `assign*`. Inside
the pipeline every stage computes on its own slice of the stacked
[S, (R,) ...] variable, bubbles must not update anything, and the backward
pass recomputes each iteration, which must neither update again nor read a
later value. So the variables are not touched inside the loop at all:

    before the loop   state = variable values          [S, (R,) ...]
    each iteration    stage s reads and "assigns" its slice of state through
                      a StageVar standing in for the variable; the loop keeps
                      the new slice where the stage was valid, the old one
                      on bubbles
    after the loop    variable.assign(final state), once

The state is loop-carried, so it is saved per iteration like the buffer and
the recomputation sees exactly the values the forward pass saw. Each logical
layer only ever touches its own slice, in microbatch order, so the final
values equal those of the plain stack run microbatch by microbatch.
"""

import itertools

import tensorflow as tf

_UPDATE_IDS = itertools.count()


class StageVar:
  """Stands in for one stage's slice of a stacked non-trainable variable.

  Reads give the current value; `assign`, `assign_add` and `assign_sub`
  replace it (functionally: nothing is written until the pipeline assigns
  the variable after its loop) and return the new value. Also accepted by
  tf.compat.v1.assign*, tf.convert_to_tensor and arithmetic.
  """

  def __init__(self, value, name):
    self._value = tf.convert_to_tensor(value)
    self._name = name

  @property
  def dtype(self):
    return self._value.dtype

  @property
  def shape(self):
    return self._value.shape

  @property
  def name(self):
    return self._name

  @property
  def trainable(self):
    return False

  def get_shape(self):
    return self._value.shape

  def value(self):
    return self._value

  def read_value(self):
    return self._value

  def assign(self, value, use_locking=False, name=None, read_value=True):
    del use_locking, name, read_value
    value = tf.convert_to_tensor(value, dtype=self.dtype)
    if not value.shape.is_compatible_with(self.shape):
      raise ValueError(
          f'Assigning a value of shape {value.shape} to non-trainable '
          f'variable {self._name} of (per-stage) shape {self.shape}.')
    # Uniquely named across graphs: Lingvo records batch-norm updates by
    # tensor name in a collection the forward and backward loop graphs share.
    self._value = tf.stop_gradient(
        tf.reshape(value, tf.shape(self._value)),
        name=f'stage_var_update_{next(_UPDATE_IDS)}')
    return self._value

  def assign_add(self, delta, use_locking=False, name=None, read_value=True):
    return self.assign(self._value + tf.cast(delta, self.dtype), use_locking,
                       name, read_value)

  def assign_sub(self, delta, use_locking=False, name=None, read_value=True):
    return self.assign(self._value - tf.cast(delta, self.dtype), use_locking,
                       name, read_value)

  def __repr__(self):
    return f'StageVar({self._name}, {self.dtype.name}{self.shape})'

  # Arithmetic, as on a tf.Variable: on the current value.
  def __add__(self, other):
    return self._value + other

  def __radd__(self, other):
    return other + self._value

  def __sub__(self, other):
    return self._value - other

  def __rsub__(self, other):
    return other - self._value

  def __mul__(self, other):
    return self._value * other

  def __rmul__(self, other):
    return other * self._value

  def __truediv__(self, other):
    return self._value / other

  def __neg__(self):
    return -self._value

  def __getitem__(self, key):
    return self._value[key]


tf.register_tensor_conversion_function(
    StageVar, lambda v, dtype=None, name=None, as_ref=False: v.value())


def NonTrainableItems(var_map):
  """[(name, variable)] of the non-trainable variables in a NestedMap."""
  return [(name, v) for name, v in var_map.FlattenItems() if not v.trainable]


def CallWithStageVars(body, fn, theta, names, current, args, kwargs):
  """Calls fn(theta, *args, **kwargs) with `body`'s named non-trainable
  variables standing for the values `current`.

  The body's theta entries and its `self.vars` reads give the carried
  values; its assignments are collected instead of written.

  Returns:
    (outputs, new values of the named variables).
  """
  if not names:
    return fn(theta, *args, **kwargs), []
  stand_ins = {
      name: StageVar(value, name) for name, value in zip(names, current)
  }
  by_id = {
      id(v): stand_ins[name]
      for name, v in body.vars.FlattenItems()
      if name in stand_ins
  }
  theta = theta.Pack([
      stand_ins[name].value() if name in stand_ins else t
      for name, t in theta.FlattenItems()
  ])
  with body.TransformVarsTempContext(lambda v: by_id.get(id(v), v)):
    out = fn(theta, *args, **kwargs)
  return out, [stand_ins[name].value() for name in names]


def TakeStageSlice(value, stage, repeat, repeats):
  """A stage's (and repeat's) slice of a [S, (R,) ...] value."""
  return repeats.Take(value[stage], repeat)


def PutStageSlice(value, stage, repeat, new, repeats):
  """The [S, (R,) ...] value with that stage's (repeat's) slice replaced."""
  slot = repeats.Put(value[stage], repeat, new)
  slots = [slot if s == stage else value[s] for s in range(value.shape[0])]
  return tf.stack(slots)
