"""Makes lingvo importable when its custom-op library cannot be loaded.

lingvo ships its C++ custom ops in one shared library,
`lingvo/core/ops/x_ops.so`. The lingvo 0.14.2 wheel builds it against glibc
2.38 (and a recent libstdc++), so on older systems such as Debian 12 (glibc
2.36) `tf.load_op_library` fails with `NotFoundError: ... GLIBC_2.38 not
found`. `lingvo/core/ops/__init__.py` loads the library at import time and
`lingvo.core.py_utils` imports that package, so without help no lingvo layer
can be imported at all.

`lingvo/core/ops/__init__.py` first tries `from lingvo.core.ops import
gen_x_ops` (the statically linked build) and only falls back to
`tf.load_op_library` when that import fails. `EnsureLingvoOps()` uses that
hook: it tries to load the real library itself and, only if that fails,
registers a stand-in module as `sys.modules['lingvo.core.ops.gen_x_ops']`
before lingvo imports its ops.

gpipe's code paths (lingvo's layers and `lingvo.core.recurrent`) reach only two
of lingvo's custom ops, and both exist purely to check shapes at run time:

* `assert_shape_match(x, y, msg)`: vectors `x` and `y` have the same length
  and every `y[i]` is either -1 (any size) or equal to `x[i]`. Used by
  `py_utils.HasShape` and `py_utils.assert_shape_match`.
* `assert_same_dim0(xs, msg)`: every tensor in `xs` has rank >= 1 and they all
  have the same leading dimension. Used by `lingvo.core.recurrent`.

The stand-in module implements these two with stock TensorFlow ops. Like the
real ops (which have no outputs), they return a `tf.Operation` when building a
graph (including inside `tf.function`), so `tf.control_dependencies([...])`
works, and the check really runs when the graph runs. In eager mode they check
immediately, raising `tf.errors.InvalidArgumentError`, and return None. Every
other lingvo custom op (beam search, vocabularies, packing, ...) becomes a
callable that raises `NotImplementedError` naming the op when it is called;
merely looking it up is fine, because lingvo's `__init__` looks all of them up
at import time.

When the real library loads, nothing is replaced and lingvo uses it as usual.

Usage: call `EnsureLingvoOps()` before anything imports `lingvo.core`.
"""

import importlib.util
import logging
import os
import sys
import threading
import types

import numpy as np
import tensorflow as tf

_GEN_X_OPS_MODULE = 'lingvo.core.ops.gen_x_ops'
_LINGVO_OPS_PACKAGE = 'lingvo.core.ops'
_FALLBACK_OPS = ('assert_shape_match', 'assert_same_dim0')

# Set by EnsureLingvoOps(). Read them as `lingvo_ops.USING_FALLBACK` (or via
# UsingFallback() / LoadError()), not with `from ... import`, which would copy
# the value at import time.
USING_FALLBACK = False
LOAD_ERROR = None

# Reentrant: looking lingvo up below runs gpipe's import hook, which calls
# EnsureLingvoOps() again (and returns at once).
_lock = threading.RLock()
_ensured = False


def EnsureLingvoOps():
  """Makes sure `lingvo.core.ops` can be imported. Safe to call repeatedly.

  Must run before `lingvo.core.ops` is first imported (directly or through
  e.g. `lingvo.core.py_utils`). If lingvo's `x_ops.so` loads, nothing else is
  done. Otherwise a fallback `gen_x_ops` module is registered (see the module
  docstring). If `lingvo.core.ops` was already imported, nothing is changed.

  Returns:
    True if the pure-TF fallback is in use, False otherwise.
  """
  global _ensured, USING_FALLBACK, LOAD_ERROR
  with _lock:
    if _ensured:
      return USING_FALLBACK
    _ensured = True
    if _LINGVO_OPS_PACKAGE in sys.modules:
      # Too late to change anything: lingvo already bound its ops.
      USING_FALLBACK = isinstance(
          sys.modules.get(_GEN_X_OPS_MODULE), _FallbackModule)
      return USING_FALLBACK
    if _GEN_X_OPS_MODULE in sys.modules:
      # Someone already provides gen_x_ops (a static build or a fallback).
      USING_FALLBACK = isinstance(sys.modules[_GEN_X_OPS_MODULE],
                                  _FallbackModule)
      return USING_FALLBACK
    so_path = _XOpsLibraryPath()
    if so_path is None:
      # lingvo is not installed; there is nothing to fix.
      return False
    error = _TryLoadOpLibrary(so_path)
    if error is None:
      return False
    LOAD_ERROR = error
    sys.modules[_GEN_X_OPS_MODULE] = _MakeFallbackModule(error)
    USING_FALLBACK = True
    logging.warning(
        'lingvo custom ops unavailable (%s); using gpipe pure-TF replacements '
        'for %s.', error, ', '.join(_FALLBACK_OPS))
    return True


def UsingFallback():
  """Returns True if lingvo's custom ops are provided by the fallback."""
  return USING_FALLBACK


def LoadError():
  """Returns the text of the x_ops.so load error, or None if none happened."""
  return LOAD_ERROR


def _XOpsLibraryPath():
  """Returns the path of lingvo's x_ops.so without importing lingvo.core."""
  spec = importlib.util.find_spec('lingvo')
  if spec is None or not spec.submodule_search_locations:
    return None
  package_dir = list(spec.submodule_search_locations)[0]
  return os.path.join(package_dir, 'core', 'ops', 'x_ops.so')


def _TryLoadOpLibrary(path):
  """Loads the op library at `path`. Returns None or the error's text."""
  try:
    tf.load_op_library(path)
  except (tf.errors.NotFoundError, OSError) as e:
    return str(getattr(e, 'message', None) or e).strip()
  return None


class _FallbackModule(types.ModuleType):
  """Type of the stand-in `gen_x_ops` module (so it can be recognized)."""


def _MakeFallbackModule(load_error):
  """Builds the stand-in for `lingvo.core.ops.gen_x_ops`."""
  module = _FallbackModule(
      _GEN_X_OPS_MODULE,
      'gpipe pure-TF stand-in for lingvo custom ops (x_ops.so failed to '
      'load: %s).' % load_error)
  module.assert_shape_match = assert_shape_match
  module.assert_same_dim0 = assert_same_dim0
  module.LOAD_ERROR = load_error

  def __getattr__(name):  # pylint: disable=invalid-name
    # PEP 562: called only for attributes the module does not define.
    if name.startswith('_'):
      raise AttributeError('module %r has no attribute %r' %
                           (_GEN_X_OPS_MODULE, name))
    return _UnavailableOp(name, load_error)

  module.__getattr__ = __getattr__
  return module


def _UnavailableOp(op_name, load_error):
  """Returns a callable standing in for a lingvo op that cannot be run."""

  def _Raise(*args, **kwargs):
    del args, kwargs  # Unused.
    raise NotImplementedError(
        "lingvo custom op '%s' is unavailable: lingvo's x_ops.so could not be "
        'loaded (%s); gpipe provides pure-TF replacements only for %s' %
        (op_name, load_error, ' and '.join(_FALLBACK_OPS)))

  _Raise.__name__ = op_name
  _Raise.__qualname__ = op_name
  return _Raise


def _AsInt64Vector(v):
  """Converts a shape-like value (list of ints/scalars or a Tensor)."""
  if not isinstance(v, tf.Tensor):
    v = tf.convert_to_tensor(v)
  return tf.reshape(tf.cast(v, tf.int64), [-1])


def _ShapesMatch(x, y):
  """Scalar bool: len(x) == len(y) and all(y[i] in (-1, x[i]))."""
  x_len = tf.size(x, out_type=tf.int64)
  y_len = tf.size(y, out_type=tf.int64)
  n = tf.maximum(x_len, y_len)
  # Pad to a common length so the elementwise test never fails on a length
  # mismatch; the length test below rejects that case anyway.
  x_pad = tf.pad(x, [[0, n - x_len]])
  y_pad = tf.pad(y, [[0, n - y_len]])
  dims_ok = tf.logical_or(tf.equal(y_pad, -1), tf.equal(x_pad, y_pad))
  return tf.logical_and(tf.equal(x_len, y_len), tf.reduce_all(dims_ok))


def _Finish(assert_op):
  """Returns None in eager mode, else a tf.Operation guarding `assert_op`."""
  if tf.executing_eagerly():
    return None
  return tf.group(assert_op)


def _Assert(condition, data):
  """A plain Assert op.

  Not tf.debugging.Assert: with int64 data that builds a tf.cond, a
  function graph per check, and Lingvo's layers check shapes hundreds of
  times per model (docs/benchmarks.md#measured-behind-the-codes-choices).
  """
  return tf.raw_ops.Assert(condition=condition, data=data, summarize=64)


def _StaticVector(v):
  """A shape-like value's entries as ints if known while building, else None.

  `v` is a Tensor or a list of ints / scalar Tensors.
  """
  if isinstance(v, (list, tuple)):
    values = [tf.get_static_value(e) if isinstance(e, tf.Tensor) else e
              for e in v]
  else:
    values = tf.get_static_value(v)
    values = None if values is None else np.reshape(values, [-1]).tolist()
  if values is None or any(e is None for e in values):
    return None
  try:
    return [int(e) for e in values]
  except (TypeError, ValueError):
    return None


def _MatchKnownWhileBuilding(x, y):
  """True when both shapes are known while building and they match."""
  x_values, y_values = _StaticVector(x), _StaticVector(y)
  if x_values is None or y_values is None or len(x_values) != len(y_values):
    return False
  return all(b in (-1, a) for a, b in zip(x_values, y_values))


def assert_shape_match(x, y, msg='', name=None):  # pylint: disable=invalid-name
  """Pure-TF stand-in for lingvo's AssertShapeMatch op.

  Args:
    x: A shape: a 1-D int Tensor or a list of ints / scalar int Tensors.
    y: The expected shape, same kind as `x`; -1 entries match any size.
    msg: Text included in the error message.
    name: Optional name scope.

  Returns:
    A `tf.Operation` that fails with InvalidArgumentError when run if the
    shapes do not match; None in eager mode, where the check runs at once.
    Shapes that are known to match while building need no check at run
    time: the operation is then a no-op.
  """
  with tf.name_scope(name or 'AssertShapeMatch'):
    if _MatchKnownWhileBuilding(x, y):
      return _Finish(tf.no_op())
    x = _AsInt64Vector(x)
    y = _AsInt64Vector(y)
    assert_op = _Assert(_ShapesMatch(x, y),
                        ['%s mismatch shape: x=' % msg, x, 'y=', y])
    return _Finish(assert_op)


def _Dim0(t):
  """Returns (rank >= 1, dim0 or -1 for scalars) of `t` as tensors."""
  shape = tf.shape(t, out_type=tf.int64)
  # Appending -1 keeps the [0] index valid for scalars (which are rejected).
  dim0 = tf.concat([shape, tf.constant([-1], tf.int64)], axis=0)[0]
  return tf.size(shape) >= 1, dim0


def assert_same_dim0(x, msg='', name=None):  # pylint: disable=invalid-name
  """Pure-TF stand-in for lingvo's AssertSameDim0 op.

  Args:
    x: A list of Tensors.
    msg: Text included in the error message.
    name: Optional name scope.

  Returns:
    A `tf.Operation` that fails with InvalidArgumentError when run unless all
    tensors have rank >= 1 and the same leading dimension; None in eager
    mode, where the check runs at once.
  """
  xs = list(x) if isinstance(x, (list, tuple)) else [x]
  with tf.name_scope(name or 'AssertSameDim0'):
    if not xs:
      return _Finish(tf.no_op())
    ranks_ok, dim0s = zip(*[_Dim0(tf.convert_to_tensor(t)) for t in xs])
    dim0s = tf.stack(dim0s)
    ok = tf.logical_and(
        tf.reduce_all(tf.stack(ranks_ok)),
        tf.reduce_all(tf.equal(dim0s, dim0s[0])))
    assert_op = _Assert(ok, [
        '%s inputs must have rank >= 1 and the same dim0; '
        'dim0s (-1 = scalar):' % msg, dim0s
    ])
    return _Finish(assert_op)
