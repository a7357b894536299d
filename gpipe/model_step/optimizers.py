"""The optimizer updates a planned training step can run, as tensor functions.

The planner lowers the training step from shapes, so the optimizer cannot be
a tf.train.Optimizer with variables of its own: each update here is a pure
function

    Update(weight, grad, slots, learning_rate, global_step)
      -> (new weight, [new slots])

and each optimizer says which slots a weight gets (`Slots`), with their own
shapes: Adafactor's factored second moment is a row and a column vector
per matrix, not a copy of the weight. Every update computes what Lingvo's
optimizer of the same name computes on a variable (checked against Lingvo's
own optimizers in tests/plan/optimizers_test.py), so the step the planner
measures is the step the task trains with:

    Lingvo (lingvo.core.optimizer)  here        slots per weight
    SGD                             Sgd         none
    Momentum                        Momentum    momentum
    Adam                            Adam        m, v
    XLAShardingAdafactor            Adafactor   [m,] vr, vc (factored) or v

`FromLingvoParams` builds one from a Lingvo optimizer's Params; any other
optimizer is refused with one line saying which are modelled.
"""

import dataclasses

import tensorflow as tf

from lingvo.core import optimizer as lingvo_optimizer


@dataclasses.dataclass(frozen=True)
class Slot:
  """One slot variable of a weight.

  `dims` are the weight dims the slot keeps, in order: all of them for a
  weight-shaped slot, all but the averaged one for a factored moment. The
  slot's shape is the weight's at those dims, so whoever places the slot
  can tell which of its dims are the weight's stage dims.
  """
  name: str
  spec: tf.TensorSpec
  dims: tuple


class Optimizer:
  """An update rule: the slots a weight gets, and the update of both."""

  def SlotDims(self, shape):
    """[(slot name, the weight dims it keeps)] for a weight of `shape`."""
    raise NotImplementedError

  def Slots(self, weight_spec):
    """The weight's slots, as `Slot`s, in the order `Update` takes them."""
    shape = weight_spec.shape.as_list()
    return [
        Slot(name, tf.TensorSpec([shape[d] for d in dims], weight_spec.dtype),
             tuple(dims)) for name, dims in self.SlotDims(shape)
    ]

  def Update(self, weight, grad, slots, learning_rate, global_step,
             grad_scale=None):
    """(new weight, [new slots]) after one step; global_step is the step's
    value before it is incremented, as Lingvo's train op reads it.

    The gradient is grad x grad_scale (a scalar: the global-norm clip's
    factor; None for 1), scaled inside the update: a scaled copy of every
    gradient made beforehand would all be held at once.
    """
    raise NotImplementedError


def _AllDims(shape):
  return tuple(range(len(shape)))


class Sgd(Optimizer):
  """Plain gradient descent (tf.train.GradientDescentOptimizer): no slots."""

  def SlotDims(self, shape):
    return []

  def Update(self, weight, grad, slots, learning_rate, global_step,
             grad_scale=None):
    del slots, global_step
    grad = _Scaled(grad, grad_scale)
    return weight - grad * tf.cast(learning_rate, weight.dtype), []


class Momentum(Optimizer):
  """tf.train.MomentumOptimizer: one accumulator per weight.

  accum <- momentum * accum + grad; the weight moves by lr * accum, or with
  Nesterov by lr * (grad + momentum * accum), as TF's kernel computes it.
  """

  def __init__(self, momentum=0.9, use_nesterov=False):
    self.momentum, self.use_nesterov = momentum, use_nesterov

  def SlotDims(self, shape):
    return [('momentum', _AllDims(shape))]

  def Update(self, weight, grad, slots, learning_rate, global_step,
             grad_scale=None):
    del global_step
    grad = _Scaled(grad, grad_scale)
    (accum,) = slots
    lr = tf.cast(learning_rate, weight.dtype)
    momentum = tf.constant(self.momentum, weight.dtype)
    accum = accum * momentum + grad
    if self.use_nesterov:
      step = grad * lr + accum * momentum * lr
    else:
      step = accum * lr
    return weight - step, [accum]


class Adam(Optimizer):
  """tf.compat.v1.train.AdamOptimizer's update: slots m and v per weight.

  TF's optimizer counts its own steps in its beta powers; they equal the
  global step + 1 when both start at zero together, as in a fresh run.
  """

  def __init__(self, beta1=0.9, beta2=0.999, epsilon=1e-8):
    self.beta1, self.beta2, self.epsilon = beta1, beta2, epsilon

  def SlotDims(self, shape):
    return [('m', _AllDims(shape)), ('v', _AllDims(shape))]

  def Update(self, weight, grad, slots, learning_rate, global_step,
             grad_scale=None):
    grad = _Scaled(grad, grad_scale)
    m, v = slots
    dtype = weight.dtype
    beta1 = tf.constant(self.beta1, dtype)
    beta2 = tf.constant(self.beta2, dtype)
    t = tf.cast(global_step + 1, dtype)
    lr = tf.cast(learning_rate, dtype)
    lr_t = lr * tf.sqrt(1 - beta2**t) / (1 - beta1**t)
    m = m + (grad - m) * (1 - beta1)
    v = v + (tf.square(grad) - v) * (1 - beta2)
    return weight - (m * lr_t) / (tf.sqrt(v) + self.epsilon), [m, v]


def _Scaled(grad, grad_scale):
  return grad if grad_scale is None else grad * tf.cast(grad_scale, grad.dtype)


def _Rms(x):
  """Root mean square of x, as Lingvo's py_utils.ReduceRms defines it.

  A scalar is its own "rms" (sign included: Lingvo returns the value), and
  a tensor of more than 1e8 elements is summed in two stages.
  """
  if x.shape.rank == 0:
    return x
  n = x.shape.num_elements()
  if n <= 1e8:
    return tf.sqrt(tf.reduce_mean(tf.square(x)))
  total = tf.reduce_sum(tf.reduce_sum(tf.square(x), -1))
  return tf.sqrt(total / tf.constant(n, x.dtype))


def _AllFinite(tensors):
  ok = tf.constant(True)
  for t in tensors:
    ok = tf.logical_and(ok, tf.reduce_all(tf.math.is_finite(t)))
  return ok


class Adafactor(Optimizer):
  """Lingvo's XLAShardingAdafactor (its XLAShardingAdafactorOptimizer).

  Second moments: a weight whose two largest dims (the earlier one first
  on a tie) are both >= min_dim_size_to_factor keeps a row and a column
  mean of the squared gradient, `vr` (the largest dim d0 averaged away)
  and `vc` (the second largest d1 averaged away); any other weight keeps
  `v` of its own shape. With beta1 > 0 a first moment `m` of the weight's
  shape comes first.

  One step, as Lingvo's optimizer computes it:
    g2 = grad^2 + epsilon1
    decay = 1 - (step - offset + 1)^-decay_exponent_pow, or without an
      exponent beta2 (1 - beta2^(t-1)) / (1 - beta2^t), t = step + 1
      (step: the global step, before this step increments it)
    vr, vc <- decay * vr, vc + (1 - decay) * mean of g2 over d0, d1
    x = grad * rsqrt(vr / mean(vr over its last dim)) [d0 re-inserted]
             * rsqrt(vc) [d1 re-inserted];  unfactored: grad * rsqrt(v)
    x /= max(1, rms(x) / clipping_threshold)   (if a threshold is set)
    update = x * lr * max(rms(weight), epsilon2)   (the last factor only
      with multiply_by_parameter_scale)
    m <- beta1 m + (1 - beta1) update; update = m   (if beta1)
    weight <- weight - update
  With cond_is_finite, the moments change only if g2 and they are finite,
  and m and the weight only if the update is too.
  """

  def __init__(self, beta1=0.0, beta2=0.999, decay_exponent_pow=None,
               decay_exponent_offset=0, multiply_by_parameter_scale=True,
               clipping_threshold=None, factored=True,
               min_dim_size_to_factor=128, epsilon1=1e-30, epsilon2=1e-3,
               cond_is_finite=False):
    self.beta1, self.beta2 = beta1, beta2
    self.decay_exponent_pow = decay_exponent_pow
    self.decay_exponent_offset = decay_exponent_offset
    self.multiply_by_parameter_scale = multiply_by_parameter_scale
    self.clipping_threshold = clipping_threshold
    self.factored = factored
    self.min_dim_size_to_factor = min_dim_size_to_factor
    self.epsilon1, self.epsilon2 = epsilon1, epsilon2
    self.cond_is_finite = cond_is_finite

  def FactoredDims(self, shape):
    """(d0, d1), the dims vr and vc average over; None: not factored."""
    if not self.factored or len(shape) < 2:
      return None
    by_size = sorted(range(len(shape)), key=lambda d: -shape[d])
    if shape[by_size[1]] < self.min_dim_size_to_factor:
      return None
    return by_size[0], by_size[1]

  def SlotDims(self, shape):
    every = _AllDims(shape)
    slots = [('m', every)] if self.beta1 else []
    factored = self.FactoredDims(shape)
    if factored:
      d0, d1 = factored
      slots += [('vr', tuple(d for d in every if d != d0)),
                ('vc', tuple(d for d in every if d != d1))]
    else:
      slots.append(('v', every))
    return slots

  def DecayRate(self, global_step):
    """The second moments' decay at this step (float32, as Lingvo's)."""
    step = tf.cast(global_step, tf.float32)
    if self.decay_exponent_pow:
      return 1.0 - tf.pow(step - self.decay_exponent_offset + 1.0,
                          -self.decay_exponent_pow)
    t = step + 1.0
    return (self.beta2 * (1.0 - tf.pow(self.beta2, t - 1.0)) /
            (1.0 - tf.pow(self.beta2, t)))

  def Update(self, weight, grad, slots, learning_rate, global_step,
             grad_scale=None):
    dtype = weight.dtype
    names = [name for name, _ in self.SlotDims(weight.shape.as_list())]
    old = dict(zip(names, slots))
    grad = _Scaled(tf.cast(grad, dtype), grad_scale)
    g2 = tf.square(grad) + tf.cast(self.epsilon1, dtype)
    decay = tf.cast(self.DecayRate(global_step), dtype)
    moments, x = self._SecondMoments(weight, grad, g2, old, decay)
    if self.clipping_threshold is not None:
      x /= tf.maximum(
          tf.constant(1.0, dtype),
          _Rms(x) / tf.constant(self.clipping_threshold, dtype))
    lr = tf.cast(learning_rate, dtype)
    if self.multiply_by_parameter_scale:
      lr = tf.maximum(_Rms(weight), tf.constant(self.epsilon2, dtype)) * lr
    update = x * lr
    new = dict(moments)
    if self.beta1:
      update = (old['m'] * tf.constant(self.beta1, dtype) +
                update * tf.constant(1.0 - self.beta1, dtype))
      new['m'] = update
    new_weight = weight - update
    if self.cond_is_finite:
      new, new_weight = self._KeepIfNotFinite(weight, old, new, new_weight,
                                              g2, update)
    return new_weight, [new[name] for name in names]

  def _SecondMoments(self, weight, grad, g2, old, decay):
    """({name: new second moment}, grad scaled by their rsqrt)."""
    mixing = tf.cast(1.0 - decay, weight.dtype)
    factored = self.FactoredDims(weight.shape.as_list())
    if not factored:
      v = old['v'] * decay + g2 * mixing
      return {'v': v}, grad * tf.math.rsqrt(v)
    d0, d1 = factored
    vr = old['vr'] * decay + tf.reduce_mean(g2, axis=d0) * mixing
    vc = old['vc'] * decay + tf.reduce_mean(g2, axis=d1) * mixing
    row = tf.math.rsqrt(vr / tf.reduce_mean(vr, -1, keepdims=True))
    col = tf.math.rsqrt(vc)
    x = grad * tf.expand_dims(row, d0) * tf.expand_dims(col, d1)
    return {'vr': vr, 'vc': vc}, x

  def _KeepIfNotFinite(self, weight, old, new, new_weight, g2, update):
    """cond_is_finite: each value keeps its old one where Lingvo's would.

    The second moments are written if g2 and they are finite; m and the
    weight if, in addition, the update is.
    """
    moments = [k for k in new if k != 'm']
    moments_ok = _AllFinite([g2] + [new[k] for k in moments])
    all_ok = tf.logical_and(moments_ok, _AllFinite([update]))
    kept = {
        k: tf.where(moments_ok if k in moments else all_ok, v, old[k])
        for k, v in new.items()
    }
    return kept, tf.where(all_ok, new_weight, weight)


def _FromAdafactor(p):
  return Adafactor(
      beta1=p.beta1, beta2=p.beta2, decay_exponent_pow=p.decay_exponent_pow,
      decay_exponent_offset=p.decay_exponent_offset,
      multiply_by_parameter_scale=p.multiply_by_parameter_scale,
      clipping_threshold=p.clipping_threshold, factored=p.factored,
      min_dim_size_to_factor=p.min_dim_size_to_factor,
      cond_is_finite=p.cond_is_finite)


# Lingvo's optimizer classes the planner models (exactly these: a subclass,
# e.g. XLAShardingAdafactorAccuGrad, may keep other slots or update
# otherwise), and how each becomes an update here.
_FROM_LINGVO = {
    lingvo_optimizer.SGD: lambda p: Sgd(),
    lingvo_optimizer.Momentum: lambda p: Momentum(p.alpha, p.use_nesterov),
    lingvo_optimizer.Adam: lambda p: Adam(p.beta1, p.beta2, p.epsilon),
    lingvo_optimizer.XLAShardingAdafactor: _FromAdafactor,
}


def FromLingvoParams(opt_params):
  """The update of a Lingvo optimizer's Params (lingvo.core.optimizer).

  Raises:
    ValueError: one line naming the optimizer and the ones modelled, for any
      other optimizer: its slots and update would be guesses.
  """
  cls = opt_params.cls if opt_params is not None else None
  build = _FROM_LINGVO.get(cls)
  if build is None:
    name = getattr(cls, '__name__', repr(cls))
    modelled = ', '.join(c.__name__ for c in _FROM_LINGVO)
    raise ValueError(
        f'The optimizer is {name}, which the planner does not model; it '
        f'models Lingvo\'s {modelled} (their slots and updates). Plan with '
        'one of them.')
  return build(opt_params)
