"""Lingvo's GShard builders, unchanged, pipelined on gpipe.

`gshard_builder`'s layer stacks (`EncoderLayerStack`, `DecoderLayerStack`)
and its `UniTransformer` task build
`gshard_layers.LayerwiseShardablePipelinedLayer` when
`spmd_pipeline_stages > 1`; under `UseGpipeInLingvo()` that is gpipe's layer.
The stack cases chain an encoder stack into a decoder stack, as Lingvo's own
builder tests do (the decoder reads the encoder's output and adds to its aux
loss): `DenseBuilder` stacks (self-attention; encoder-decoder attention and a
dense feed-forward layer) and `MoEBuilder` stacks (an MoE feed-forward layer
each, with its aux loss). The task case is Lingvo's `UniTransformer` test
model (relative-bias decoder self-attention, feed-forward), with
`num_spmd_pipeline_stages`. The cases run with S = 2 and 4 stages, in
training and in eval mode: a pairwise covering (tests/covering.py) of the
three models, the two S and the two modes, each model with each S and in
each mode, each S in each mode (6 of the 12). Each against a reference
that runs no gpipe code:

* Training: Lingvo's own pipelined layer, from the same builder params built
  without the switch. Both models must have the same variable names and
  shapes; gpipe's initial weights are copied into the reference. Compared:
  the stacks' outputs and aux losses (the task's loss and metrics), and the
  gradients of every variable (and of the stacks' float inputs).
* Eval: the builders' pipeline layer runs unrolled (`unroll='eval_only'`) on
  inputs the builder has already split into microbatches, `[M, B/M, ...]`.
  Lingvo's own layer cannot (its unrolled path wants unsplit inputs; see
  `test_lingvos_own_layer_cannot_run_the_builders_eval_path`). The reference
  is the same builder with `spmd_pipeline_stages=1`: a plain stack of the
  same layers, also built and run in eval mode, holding stage s's slice of
  each gpipe variable as its layer `s * len(sub_layers) + k`. (Lingvo's
  pipelined layer in training mode would not do: eval-mode layers compute
  differently; on CPU an eval MoE layer groups its tokens by example, not
  into `num_groups` groups per microbatch.) The pipelined stack sums its
  microbatches' aux losses and adds the input's aux loss once, so the stack
  reference runs the plain stacks once per microbatch (rows m, m + M, ...,
  the builder's split) and sums likewise; the task has no aux loss and its
  reference runs once on the whole batch. Compared: outputs, aux losses, the
  task's loss and metrics.

Dropout is 0; float32. Tolerance: close.FLOAT32_AT_SCALE (atol relative to
the largest entry; tests/close.py says why).
"""

import re

import numpy as np
import pytest

import gpipe  # pylint: disable=unused-import
import tensorflow as tf
from gpipe import layers
from gpipe import lingvo_compat
from lingvo.core import cluster_factory
from lingvo.core import gshard_builder
from lingvo.core import py_utils
from tests import close
from tests import covering
from tests import sessions

DIM, HEADS, KV_DIM, HIDDEN, TIME, BATCH, VOCAB = 8, 2, 4, 16, 4, 8, 16
EXPERTS, CAPACITY = 2, 4

# (stages S, microbatches M): M > S and M < S.
_STAGES = [(2, 4), (4, 2)]
_MODES = ['eval', 'train']


def _AssertAllClose(got, want, names):
  assert len(got) == len(want) == len(names)
  for name, g, w in zip(names, got, want):
    close.AssertClose(g, w, close.FLOAT32_AT_SCALE, name)


def _AssertNonzero(grads, names):
  """Every variable (and input) takes part: its gradient is not all 0."""
  for name, g in zip(names, grads):
    assert np.abs(g).max() > 0, name


def _Run(fetches, assign_ops):
  """Initializes, copies the weights, runs `fetches` once."""
  with sessions.AsBuilt() as sess:
    sess.run(tf.compat.v1.global_variables_initializer())
    sess.run(assign_ops)
    return sess.run(fetches)


def _Find(layer, cls):
  """All layers of class `cls` among `layer` and its descendants."""
  found = [layer] if isinstance(layer, cls) else []
  for child in layer.children.Flatten():
    found += _Find(child, cls)
  return found


def _AssertBuiltWith(model, cls, count):
  """`model` has `count` pipelined layers, all of class `cls`."""
  ours = _Find(model, layers.PipelinedLayer)
  lingvos = _Find(model, lingvo_compat.LingvosOwnLayer())
  assert len(ours) + len(lingvos) == count
  assert len(_Find(model, cls)) == count


def _Gradients(loss, xs):
  return [tf.convert_to_tensor(g) for g in tf.gradients(loss, xs)]


def _Names(model):
  """Variable names below the model's own name."""
  root = model.params.name + '/'
  names = [v.name for v in model.vars.Flatten()]
  assert all(n.startswith(root) for n in names), names
  return [n[len(root):] for n in names]


def _CopySameShapes(ours, theirs):
  """Ops that copy `ours`' variables to `theirs`: same names and shapes."""
  src, dst = ours.vars.Flatten(), theirs.vars.Flatten()
  assert _Names(ours) == _Names(theirs)
  assert [v.shape for v in src] == [v.shape for v in dst]
  return [d.assign(s) for s, d in zip(src, dst)]


_BODY_LAYER = re.compile(r'(.*)pipeline/pipeline_body/layer_(\d+)/(.*)')


def _StageSlices(ours, plain, num_sub_layers, stages):
  """Per variable of `ours`: the plain model's variable(s) it holds.

  `.../pipeline/pipeline_body/layer_k/...`, of shape [S, ...], holds at
  index s the plain model's `.../layer_j/...` with j = s * num_sub_layers +
  k (a list of S variables); any other variable is the plain model's
  variable of the same name. Every plain variable is used exactly once.
  """
  plain_vars = dict(zip(_Names(plain), plain.vars.Flatten()))
  slices, used = [], []
  for name, v in zip(_Names(ours), ours.vars.Flatten()):
    match = _BODY_LAYER.fullmatch(name)
    if not match:
      assert plain_vars[name].shape == v.shape, name
      slices.append(plain_vars[name])
      used.append(name)
      continue
    prefix, k, rest = match.groups()
    names = ['%slayer_%03d/%s' % (prefix, s * num_sub_layers + int(k), rest)
             for s in range(stages)]
    assert v.shape[0] == stages, name
    assert all(plain_vars[n].shape == v.shape[1:] for n in names), name
    slices.append([plain_vars[n] for n in names])
    used += names
  assert sorted(used) == sorted(plain_vars)
  return slices


def _CopyStageSlices(ours, slices):
  copy = []
  for v, targets in zip(ours.vars.Flatten(), slices):
    if isinstance(targets, list):
      copy += [t.assign(v[s]) for s, t in enumerate(targets)]
    else:
      copy.append(targets.assign(v))
  return copy


def _Segments(rng):
  """Packed and padded segment ids and positions, [BATCH, TIME] int32."""
  choices = [([1, 1, 1, 1], [0, 1, 2, 3]), ([1, 1, 2, 2], [0, 1, 0, 1]),
             ([1, 1, 1, 0], [0, 1, 2, 0]), ([1, 2, 2, 2], [0, 0, 1, 2])]
  picks = rng.randint(0, len(choices), [BATCH])
  seg = np.array([choices[i][0] for i in picks], np.int32)
  pos = np.array([choices[i][1] for i in picks], np.int32)
  return seg, pos


# Layer stacks.


def _Builder(kind):
  """A tiny DenseBuilder ('dense') or MoEBuilder ('moe'), no dropout."""
  if kind == 'dense':
    return gshard_builder.DenseBuilder.Params().Set(
        model_dim=DIM, attention_num_heads=HEADS,
        attention_key_value_dim=KV_DIM, ff_dim=HIDDEN, dropout_rate=0.0,
        device_mesh=None, device_mesh_shape=None).Instantiate()
  return gshard_builder.MoEBuilder.Params().Set(
      model_dim=DIM, attention_num_heads=HEADS, attention_key_value_dim=KV_DIM,
      moe_hidden_dim=HIDDEN, e_dim=EXPERTS, c_dim=CAPACITY, num_groups=1,
      num_devices=1, dropout_rate=0.0).Instantiate()


def _Stacks(kind, name, num_layers, stages, microbatches):
  """The builder's encoder and decoder stacks, and their sub-layer counts.

  Each has `num_layers` layers, pipelined over `stages` if > 1.
  """
  b = _Builder(kind)
  if kind == 'dense':
    enc_subs = [b.SelfAttention('self_attention')]
    dec_subs = [b.DecEncAttention('dec_enc_attention'),
                b.DenseReluDense('ffw', decoder=True)]
  else:
    enc_subs = [b.MoE('moe')]
    dec_subs = [b.MoE('moe', decoder=True)]
  stacks = []
  for stack, suffix, subs in ((b.EncoderLayerStack, 'enc', enc_subs),
                              (b.DecoderLayerStack, 'dec', dec_subs)):
    p = stack(name + '_' + suffix, subs, num=num_layers,
              spmd_pipeline_stages=stages,
              spmd_pipeline_microbatches=microbatches)
    p.params_init = py_utils.WeightInit.Xavier(scale=1.0, seed=0)
    stacks.append(p.Instantiate())
  return stacks, (len(enc_subs), len(dec_subs))


def _StackInputs():
  rng = np.random.RandomState(0)
  seg, pos = _Segments(rng)
  enc = dict(vec=rng.normal(size=[BATCH, TIME, DIM]).astype(np.float32),
             segment_id=seg, segment_pos=pos, aux_loss=np.float32(0.25))
  dec_seg, dec_pos = _Segments(rng)
  dec = dict(vec=rng.normal(size=[BATCH, TIME, DIM]).astype(np.float32),
             segment_id=dec_seg, segment_pos=dec_pos, encoder_segment_id=seg,
             encoder_segment_pos=pos)
  return (py_utils.NestedMap({k: tf.constant(v) for k, v in enc.items()}),
          py_utils.NestedMap({k: tf.constant(v) for k, v in dec.items()}))


def _EncDec(enc, dec, enc_in, dec_in):
  """Lingvo's chaining: the decoder reads the encoder's output, aux loss."""
  enc_out = enc.FPropDefaultTheta(enc_in)
  dec_in = py_utils.NestedMap(
      dec_in, encoder_output=enc_out.vec, aux_loss=enc_out.aux_loss)
  return enc_out, dec.FPropDefaultTheta(dec_in)


def _Objective(outs):
  return tf.add_n([tf.reduce_sum(o.vec * tf.sin(o.vec)) + o.aux_loss
                   for o in outs])


def _MicrobatchByMicrobatch(enc, dec, enc_in, dec_in, m_count):
  """Plain stacks on each microbatch, put together as the pipeline does."""
  outs = []
  for m in range(m_count):

    def Take(x, m=m):
      return x[m::m_count] if x.shape.rank else x

    enc_mb, dec_mb = enc_in.Transform(Take), dec_in.Transform(Take)
    if m:  # The input's aux loss enters once.
      enc_mb.aux_loss = tf.zeros_like(enc_in.aux_loss)
    outs.append(_EncDec(enc, dec, enc_mb, dec_mb))

  def Join(i):
    vec = tf.stack([o[i].vec for o in outs], axis=1)  # [B/M, M, ...]
    return py_utils.NestedMap(
        vec=tf.reshape(vec, [BATCH] + vec.shape[2:].as_list()),
        aux_loss=tf.add_n([o[i].aux_loss for o in outs]))

  return Join(0), Join(1)


# The models: the builders' dense and MoE stacks, and the UniTransformer.
_FULL_CASES = [(kind, *stages, mode) for kind in ('dense', 'moe', 'uni')
               for stages in _STAGES for mode in _MODES]
# Pairwise over (model, (S, M), mode) (covering.py): 6 of the product's 12;
# the stacks every two of kind, (S, M) and mode together (4 of their 8).
_CASES_FEATURES = (lambda c: c[0], lambda c: c[1:3], lambda c: c[3])
_CASES = covering.Pairwise(
    _FULL_CASES, _CASES_FEATURES,
    must=[('dense', *_STAGES[0], 'train'), ('dense', *_STAGES[1], 'eval'),
          ('moe', *_STAGES[0], 'eval'), ('moe', *_STAGES[1], 'train')])
_STACK_CASES = [c for c in _CASES if c[0] != 'uni']
_TASK_CASES = [c[1:] for c in _CASES if c[0] == 'uni']


@pytest.mark.runs_long
@pytest.mark.parametrize('kind,stages,microbatches,mode', _STACK_CASES)
def test_layer_stacks_equal_reference(kind, stages, microbatches, mode):
  is_eval = mode == 'eval'
  with tf.Graph().as_default(), cluster_factory.SetEval(is_eval):
    tf.random.set_seed(1)  # Reproducible initial weights.
    py_utils.GetOrCreateGlobalStepVar()
    with lingvo_compat.UseGpipeInLingvo():
      ours, num_subs = _Stacks(kind, 'ours', stages, stages, microbatches)
    for stack in ours:
      _AssertBuiltWith(stack, layers.PipelinedLayer, 1)
    enc_in, dec_in = _StackInputs()
    outs = _EncDec(*ours, enc_in, dec_in)
    fetches = [o.vec for o in outs] + [o.aux_loss for o in outs]
    names = ['enc vec', 'dec vec', 'enc aux_loss', 'dec aux_loss']
    if not is_eval:
      theirs, _ = _Stacks(kind, 'theirs', stages, stages, microbatches)
      for stack in theirs:
        _AssertBuiltWith(stack, lingvo_compat.LingvosOwnLayer(), 1)
      ref_outs = _EncDec(*theirs, enc_in, dec_in)
      copy = sum((_CopySameShapes(o, t) for o, t in zip(ours, theirs)), [])
      floats = [enc_in.vec, dec_in.vec]
      variables = sum((o.vars.Flatten() for o in ours), [])
      ref_variables = sum((t.vars.Flatten() for t in theirs), [])
      fetches += _Gradients(_Objective(outs), variables + floats)
      ref_fetches = [o.vec for o in ref_outs] + [o.aux_loss for o in ref_outs]
      ref_fetches += _Gradients(_Objective(ref_outs), ref_variables + floats)
      names += ['d/d ' + v.name for v in variables]
      names += ['d/d enc input', 'd/d dec input']
    else:
      plain, _ = _Stacks(kind, 'plain', stages, 1, None)
      for stack in plain:
        _AssertBuiltWith(stack, layers.PipelinedLayer, 0)
      ref_outs = _MicrobatchByMicrobatch(*plain, enc_in, dec_in, microbatches)
      copy = []
      for o, p, n in zip(ours, plain, num_subs):
        copy += _CopyStageSlices(o, _StageSlices(o, p, n, stages))
      ref_fetches = [o.vec for o in ref_outs] + [o.aux_loss for o in ref_outs]
    got, want = _Run((fetches, ref_fetches), copy)
  _AssertAllClose(got, want, names)
  _AssertNonzero(want[4:], names[4:])
  if kind == 'moe':  # Both stacks add their MoE layers' aux losses.
    assert want[3] > want[2] > 0.25


def test_lingvos_own_layer_cannot_run_the_builders_eval_path():
  """Why the eval reference is not Lingvo's pipelined layer."""
  with tf.Graph().as_default(), cluster_factory.SetEval(True):
    (enc, _), _ = _Stacks('dense', 'theirs', 2, 2, 2)
    _AssertBuiltWith(enc, lingvo_compat.LingvosOwnLayer(), 1)
    enc_in, _ = _StackInputs()
    with pytest.raises(ValueError, match='rank 3 but is rank 4'):
      enc.FPropDefaultTheta(enc_in)


# UniTransformer.


_TASK_SUB_LAYERS = 2  # Per transformer layer: attention, feed-forward.


def _TaskParams(name, stages, microbatches):
  """Lingvo's UniTransformer test model, tiny: relative-bias attention, FFN."""
  builder = gshard_builder.DenseBuilder.Params().Set(
      device_mesh_shape=[1, 1], device_mesh=None, dtype=tf.float32,
      relative_attention_type='bias', relative_attention_num_buckets=8,
      relative_attention_max_distance=16,
      relative_attention_use_universal_1d_position=True, num_devices=1,
      model_dim=DIM, attention_num_heads=HEADS, ff_dim=HIDDEN,
      attention_key_value_dim=KV_DIM, attention_combine_dims=True,
      dropout_rate=0.0)
  return gshard_builder.UniTransformer.Params().Set(
      name=name, builder=builder, dtype=tf.float32, gated_gelu=False,
      positional_embedding=False, batch_size=BATCH, sequence_length=TIME,
      max_length=TIME, vocab_size=VOCAB, num_transformer_layers=stages,
      num_spmd_pipeline_stages=stages,
      num_spmd_pipeline_microbatches=microbatches)


def _TaskInputs():
  rng = np.random.RandomState(1)
  seg, pos = _Segments(rng)
  ids = rng.randint(1, VOCAB, [BATCH, TIME]).astype(np.int32) * (seg > 0)
  labels = rng.randint(1, VOCAB, [BATCH, TIME]).astype(np.int32) * (seg > 0)
  tgt = py_utils.NestedMap(ids=ids, labels=labels, segment_ids=seg,
                           segment_pos=pos)
  return py_utils.NestedMap(tgt=tgt.Transform(tf.constant))


def _TaskFProp(model):
  """The task's metrics: name -> value (Lingvo gives (value, weight))."""
  metrics, _ = model.FPropDefaultTheta(_TaskInputs())
  return {k: v for k, (v, _) in metrics.items()}


@pytest.mark.parametrize('stages,microbatches,mode', _TASK_CASES)
def test_uni_transformer_equals_reference(stages, microbatches, mode):
  is_eval = mode == 'eval'
  with tf.Graph().as_default(), cluster_factory.SetEval(is_eval):
    tf.random.set_seed(1)  # Reproducible initial weights.
    py_utils.GetOrCreateGlobalStepVar()
    with lingvo_compat.UseGpipeInLingvo():
      ours = _TaskParams('ours', stages, microbatches).Instantiate()
    _AssertBuiltWith(ours, layers.PipelinedLayer, 1)
    metrics = _TaskFProp(ours)
    keys = sorted(metrics)
    grads, ref_grads, names = [], [], []
    if not is_eval:
      theirs = _TaskParams('theirs', stages, microbatches).Instantiate()
      _AssertBuiltWith(theirs, lingvo_compat.LingvosOwnLayer(), 1)
      ref_metrics = _TaskFProp(theirs)
      copy = _CopySameShapes(ours, theirs)
      grads = _Gradients(metrics['loss'], ours.vars.Flatten())
      ref_grads = _Gradients(ref_metrics['loss'], theirs.vars.Flatten())
      names = ['d loss/d ' + n for n in _Names(ours)]
    else:
      plain = _TaskParams('plain', stages, microbatches).Set(
          num_spmd_pipeline_stages=1).Instantiate()
      _AssertBuiltWith(plain, layers.PipelinedLayer, 0)
      ref_metrics = _TaskFProp(plain)
      copy = _CopyStageSlices(ours, _StageSlices(ours, plain, _TASK_SUB_LAYERS,
                                                stages))
    assert keys == sorted(ref_metrics)
    got, want = _Run(([metrics[k] for k in keys] + grads,
                      [ref_metrics[k] for k in keys] + ref_grads), copy)
  _AssertAllClose(got, want, keys + names)
  _AssertNonzero(want[len(keys):], names)
