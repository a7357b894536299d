"""The commands' own code (the commands are gpipe.check_partitioning,
gpipe.demo, gpipe.lingvo_trainer, gpipe.plan and gpipe.schedule).

    trainer          graph-mode training of a registered model, with
                     checkpoints and TensorBoard events (gpipe.demo)
    held_out_text    a trained text LM on held-out text: bits per byte
                     beside gzip and xz, a continuation sampled through the
                     pipeline (gpipe.demo)
    prompt_exit      a command's end, without collecting its objects first
"""
