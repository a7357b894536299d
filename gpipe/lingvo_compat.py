"""Lingvo's own pipelined model code, run on gpipe.

Lingvo's clients of its pipeline layer — `batch_major_attention.
PipelinedTransformerLayers` and the GShard builders (`gshard_builder`) —
build `gshard_layers.LayerwiseShardablePipelinedLayer` themselves, by that
name, when their layers are constructed. `UseGpipeInLingvo` points the name
at gpipe's `PipelinedLayer` (same Params, same variable names and shapes):

    from gpipe import lingvo_compat
    lingvo_compat.UseGpipeInLingvo()          # from now on
    with lingvo_compat.UseGpipeInLingvo():    # or only inside the block
      model = model_params.Instantiate()

Importing gpipe alone does not switch Lingvo to gpipe's layer. Params built
before the switch keep the class they name (`p.cls`).
"""

from gpipe import layers
from gpipe.pipeline import layer_params
from lingvo.core import gshard_layers
from lingvo.core import hyperparams

__all__ = [
    'UseGpipeInLingvo',
    'LingvoBuildsGpipe',
    'LingvosOwnLayer',
    'AsLingvosOwnLayer',
    'StagesOverDevicesLayer',
]

_LINGVO_LAYER = gshard_layers.LayerwiseShardablePipelinedLayer


class StagesOverDevicesLayer(layers.PipelinedLayer):
  """gpipe's layer, its stage dim over num_stages devices unless told.

  Lingvo's GShard builders (`MoEBuilder.ShardablePipeline`) create the
  pipelined layer with neither shard_stages_1d nor pipeline_stage_mesh_dim,
  so its stage-stacked weights live whole on every device. Built as this
  class, such a layer gets shard_stages_1d; a layer whose Params place
  its stages keeps that place.
  """

  def __init__(self, params):
    if not params.shard_stages_1d and params.pipeline_stage_mesh_dim is None:
      params = params.Copy().Set(shard_stages_1d=True)
    super().__init__(params)


class UseGpipeInLingvo:
  """Makes Lingvo build gpipe's layer; as a context manager, until exit.

  With `split_unplaced_stages`, the layer built is StagesOverDevicesLayer:
  a builder's stack that places its stages nowhere gets them split over
  num_stages devices (as a pod run needs; the planner builds such a model
  this way).
  """

  def __init__(self, split_unplaced_stages: bool = False):
    self._previous = gshard_layers.LayerwiseShardablePipelinedLayer
    gshard_layers.LayerwiseShardablePipelinedLayer = (
        StagesOverDevicesLayer if split_unplaced_stages else
        layers.PipelinedLayer)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    gshard_layers.LayerwiseShardablePipelinedLayer = self._previous
    return False


def LingvoBuildsGpipe() -> bool:
  """True while Lingvo's pipeline layer name means gpipe's layer."""
  return issubclass(gshard_layers.LayerwiseShardablePipelinedLayer,
                    layers.PipelinedLayer)


def LingvosOwnLayer() -> type:
  """Lingvo's own LayerwiseShardablePipelinedLayer, switched or not."""
  return _LINGVO_LAYER


def AsLingvosOwnLayer(params: hyperparams.Params) -> hyperparams.Params:
  """Lingvo's own layer's Params from gpipe PipelinedLayer Params.

  Lingvo's layer has every Params name gpipe's has but gpipe's own
  (gpipe.pipeline.layer_params.DefineGpipes: the remat policy, as it always
  recomputes; vectorize_stages, as it always vectorizes; skip_bubbles and
  layer_by_layer, as it always runs its schedule), so
  the same stack can be built with either layer, e.g. to plan both side by
  side (python -m gpipe.plan --pipeline_layer lingvo).
  """
  lingvo_p = _LINGVO_LAYER.Params()
  own = hyperparams.Params()
  layer_params.DefineGpipes(own)
  for name, value in params.IterParams():
    if name in own or name == 'cls':
      continue
    lingvo_p.Set(**{name: value.Copy() if hasattr(value, 'Copy') else value})
  return lingvo_p
