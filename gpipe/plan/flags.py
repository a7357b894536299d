"""The planner's flags, read before TensorFlow loads (--help answers at once).

Only modules that load no TensorFlow are imported here.
"""

import argparse
import math
import os

from gpipe.loops import remat
from gpipe import plan as plan_package
from gpipe.plan import roofline
from gpipe import quiet


def _IntList(text):
  try:
    values = [int(v) for v in text.split(',') if v]
  except ValueError:
    raise argparse.ArgumentTypeError(
        f'expected comma-separated integers, got {text!r}') from None
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(
        f'expected positive integers, got {text!r}')
  return values


def _Positive(convert, what, text):
  """A finite number above 0: a size or count of 0 or less means nothing."""
  try:
    value = convert(text)
  except ValueError:
    raise argparse.ArgumentTypeError(
        f'expected {what} above 0, got {text!r}') from None
  if not value > 0 or math.isinf(value):
    raise argparse.ArgumentTypeError(
        f'expected {what} above 0, got {text!r}')
  return value


def _PositiveInt(text):
  return _Positive(int, 'an integer', text)


def _PositiveFloat(text):
  return _Positive(float, 'a number', text)


def _PlotPath(text):
  """A .png path whose directory exists and is writable, checked before
  anything is compiled."""
  if not text.lower().endswith('.png'):
    raise argparse.ArgumentTypeError(f'expected a .png file, got {text!r}')
  directory = os.path.dirname(os.path.abspath(text))
  if not os.path.isdir(directory):
    raise argparse.ArgumentTypeError(
        f'{text!r}: directory {directory!r} does not exist')
  if os.path.isdir(text) or not os.access(directory, os.W_OK):
    raise argparse.ArgumentTypeError(f'{text!r}: cannot write there')
  return text


def _Shape(text):
  return tuple(_IntList(text))


def _Dims(shape):
  """'8x1x4' -> (8, 1, 4); () unless each is a positive integer."""
  try:
    dims = tuple(int(d) for d in shape.split('x'))
  except ValueError:
    return ()
  return dims if dims and min(dims) >= 1 else ()


def _Slice(text):
  """'4x8' -> (4, 8)."""
  dims = _Dims(text)
  if not dims:
    raise argparse.ArgumentTypeError(
        f'expected a slice shape like 4x8 or 16x16, got {text!r}')
  return dims


def _MeshList(text):
  """'8x1x4,4x2x4' -> [(8, 1, 4), (4, 2, 4)]."""
  meshes = []
  for shape in (t for t in text.split(',') if t):
    dims = _Dims(shape)
    if not dims:
      raise argparse.ArgumentTypeError(
          f'expected mesh shapes like 8x1x4,4x2x4, got {text!r}')
    meshes.append(dims)
  if not meshes:
    raise argparse.ArgumentTypeError(
        f'expected mesh shapes like 8x1x4,4x2x4, got {text!r}')
  return meshes


def _PolicyList(text):
  values = [v for v in text.split(',') if v]
  unknown = [v for v in values if v not in remat.POLICIES]
  if not values or unknown:
    raise argparse.ArgumentTypeError(
        f'expected names from {", ".join(remat.POLICIES)}, got {text!r}')
  return values


def _ScheduleList(text):
  values = [v for v in text.split(',') if v]
  unknown = [v for v in values if v not in ('reverse', '1f1b')]
  if not values or unknown:
    raise argparse.ArgumentTypeError(
        f'expected names from reverse, 1f1b, got {text!r}')
  return values


_BOOLS = {'true': True, 'false': False}


def _FsdpList(text):
  """'none,1' -> [-1, 1] (targets.NO_FSDP for none)."""
  values = []
  for v in (v.strip().lower() for v in text.split(',') if v.strip()):
    if v == 'none':
      values.append(-1)
    elif v.isdigit():
      values.append(int(v))
    else:
      values = []
      break
  if not values:
    raise argparse.ArgumentTypeError(
        f'expected mesh axes or none (e.g. none,1), got {text!r}')
  return values


def _BoolList(text):
  """'false,true' -> [False, True]."""
  values = [v.strip().lower() for v in text.split(',') if v.strip()]
  if not values or any(v not in _BOOLS for v in values):
    raise argparse.ArgumentTypeError(
        f'expected true, false or both (false,true), got {text!r}')
  return [_BOOLS[v] for v in values]


def _AddChipFlags(parser):
  """The TPU the roofline models, and where the mesh lies on its slice."""
  parser.add_argument('--tpu', choices=sorted(roofline.CHIPS), default='v6e',
                      help='TPU generation of the roofline model')
  parser.add_argument('--hbm_gib', type=_PositiveFloat, default=None,
                      help='HBM per chip in GiB (default: the generation\'s)')
  parser.add_argument('--links_per_axis', type=_Shape, default=None,
                      metavar='1,4,1',
                      help='per mesh axis, the ICI links (one direction '
                      'each) a chip\'s collective along it drives at once, '
                      'e.g. 1,4,1 for FSDP over a whole v5e pod (both '
                      'dimensions closed); default 1 each, a slice with no '
                      'wraparound (see gpipe.plan.torus)')
  parser.add_argument('--slice', type=_Slice, default=None, metavar='4x8',
                      help='the slice\'s ICI dimensions, e.g. 4x8 or 16x16 '
                      'for a v5e pod: each candidate\'s links per mesh axis '
                      'follow from its mesh laid on them (a v5e/v6e '
                      'dimension closes at 16); instead of --links_per_axis')


def Parse(argv=None):
  """(parser, parsed arguments) of python -m gpipe.plan."""
  parser = argparse.ArgumentParser(
      prog='python -m gpipe.plan',
      description=plan_package.__doc__.split('\n\n')[0],
      formatter_class=quiet.HelpFormatter)
  what = parser.add_mutually_exclusive_group(required=True)
  what.add_argument('--model', help='a registered Lingvo model, e.g. '
                    'lm.CopyLMPod8x2')
  parser.add_argument('--model_module', action='append', default=[],
                      help='with --model: a module to import first, which '
                      'registers models of your own (a dotted name, or a '
                      'path to its .py file); repeat for several')
  what.add_argument('--params', help='PipelinedLayer Params, or a function '
                    'returning them: module.attribute of an importable '
                    'module, or path/to/file.py:attribute')
  parser.add_argument('--pipeline_layer', choices=('gpipe', 'lingvo'),
                      default='gpipe',
                      help='build the stack with gpipe\'s PipelinedLayer or Lingvo\'s own '
                      'LayerwiseShardablePipelinedLayer (same Params)')
  parser.add_argument('--input_shape', type=_Shape, action='append',
                      help='with --params: one input\'s shape, batch first; '
                      'repeat for several inputs')
  parser.add_argument('--num_devices', type=_PositiveInt, default=None,
                      help='devices of the slice (default: num_stages, or '
                      'the size of device_mesh)')
  _AddChipFlags(parser)
  parser.add_argument('--num_microbatches', type=_IntList, default=None,
                      help='candidates, e.g. 8,16,32 (default: the model\'s)')
  parser.add_argument('--circular_repeat', type=_IntList, default=None,
                      help='candidates, e.g. 1,2,4 (default: the model\'s)')
  parser.add_argument('--remat_policy', type=_PolicyList, default=None,
                      help='candidates, e.g. recompute,save_all (default: '
                      'the model\'s); see gpipe.loops.remat')
  parser.add_argument('--backward_schedule', type=_ScheduleList,
                      default=None,
                      help='candidates, e.g. reverse,1f1b (default: the '
                      'model\'s); see gpipe.pipeline.one_f_one_b')
  parser.add_argument('--stream_io', type=_BoolList, nargs='?',
                      const=[True], default=None, metavar='false,true',
                      help='candidates: --stream_io alone is true; or '
                      'false, true, false,true (default: the model\'s); '
                      'see gpipe.pipeline.loop_io')
  parser.add_argument('--mesh', type=_MeshList, default=None,
                      help='candidate device meshes for a model on a mesh, '
                      'e.g. 8x1x4,4x2x4: the stage axis gives num_stages '
                      '(depth kept), the others what the body splits over '
                      'them; each of --num_devices devices (default: the '
                      'model\'s own)')
  parser.add_argument('--fsdp_mesh_dim', type=_FsdpList, default=None,
                      metavar='none,1',
                      help='candidates: the mesh axis the stage body also '
                      'stores its weights (and slots) split over, gathering '
                      'them where it uses them (FSDP), or none (default: '
                      'the body\'s own); see params/fsdp.py')
  parser.add_argument('--depth_param', default='num_blocks',
                      help='stage-body param holding its depth, scaled to '
                      'keep S x R x depth fixed as circular_repeat varies')
  parser.add_argument('--compile_timeout_minutes', type=_PositiveFloat,
                      default=30, help='the longest one candidate\'s compile '
                      'may take before it is stopped (a large model\'s '
                      'whole batch at once may need more)')
  parser.add_argument('--verbose', action='store_true',
                      help='also show TensorFlow, XLA and Lingvo logs')
  parser.add_argument('--json', action='store_true',
                      help='print the report as JSON')
  parser.add_argument('--plot', type=_PlotPath, default=None,
                      metavar='FILE.png',
                      help='also draw each candidate\'s bytes per chip '
                      '(weights, optimizer slots, stored activations, other '
                      'temporaries) against the HBM size')
  return parser, parser.parse_args(argv)
