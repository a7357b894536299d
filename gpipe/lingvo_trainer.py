"""Lingvo's own trainer program, with gpipe's model params registered.

    python -m gpipe.lingvo_trainer --model=lm.CopyLMSmall --run_locally=cpu \\
        --mode=sync --logdir=/tmp/copy_lm
    python -m gpipe.lingvo_trainer --model=lm.CopyLMSmall --run_locally=cpu \\
        --mode=sync --logdir=/tmp/copy_lm --job=evaler_dev
    python -m gpipe.lingvo_trainer --model=lm.CopyLMSmall --run_locally=cpu \\
        --mode=sync --logdir=/tmp/copy_lm --job=decoder_dev

Every flag is Lingvo's (`lingvo.trainer`): jobs, cluster, TPU and logdir
flags work as they do there. What this adds: Lingvo made importable on this
system (gpipe's import hook), and the models in `params/` registered, so
`--model=lm.<Name>` finds them. The trainer stops at the model's
`train.max_steps`; the evaler and decoder jobs evaluate each new checkpoint
and stop after the one at `train.max_steps`.
"""

import sys

import gpipe  # pylint: disable=unused-import  (makes lingvo importable)


def main(argv=None):
  argv = list(sys.argv if argv is None else argv)
  import params.lm  # pylint: disable=g-import-not-at-top,unused-import
  from lingvo import trainer  # pylint: disable=g-import-not-at-top
  from lingvo import compat as tf  # pylint: disable=g-import-not-at-top
  from lingvo import model_imports  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top

  flags = tf.flags.FLAGS
  tf.flags.mark_flag_as_required('model')
  flags(argv, known_only=True)
  if flags.disable_tf2:
    tf.disable_v2_behavior()
  py_utils.SetEagerMode(flags.use_eager)
  model_imports.ImportParams(flags.model)
  if _Trains(flags.job) and flags.logdir:
    _WriteScheduleImage(flags.model, flags.logdir)
  flags.unparse_flags()
  tf.app.run(trainer.main, argv=argv)


def _Trains(job):
  """Whether the job list runs training (Lingvo's default runs all)."""
  return not job or any(j.startswith(('controller', 'trainer', 'executor'))
                        for j in job.split(','))


def _WriteScheduleImage(model, logdir):
  """The pipeline schedule of a pipelined model, as an image in
  <logdir>/train, at the step training starts from.

  Lingvo's controller writes the graph's image summaries on its own
  10-second cadence, which a short run never reaches; this is written once,
  before training, from the params alone.
  """
  import os  # pylint: disable=g-import-not-at-top
  from gpipe import layers  # pylint: disable=g-import-not-at-top
  from gpipe import trainer as gpipe_trainer  # pylint: disable=g-import-not-at-top
  from lingvo import model_registry  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cfg = model_registry.GetParams(model, 'Train')
  stack = cfg.task.Get('stack') if 'stack' in cfg.task else None
  if stack is None or not issubclass(stack.cls, layers.PipelinedLayer):
    return
  train_dir = os.path.join(logdir, 'train')
  writer = tf.compat.v1.summary.FileWriter(train_dir)
  writer.add_summary(gpipe_trainer.ScheduleImage(cfg),
                     gpipe_trainer.CheckpointStep(train_dir))
  writer.close()


if __name__ == '__main__':
  main()
