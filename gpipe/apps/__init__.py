"""The commands' own code (the commands are gpipe.check_partitioning,
gpipe.demo, gpipe.lingvo_trainer, gpipe.plan and gpipe.schedule).

    trainer          graph-mode training of a registered model, with
                     checkpoints and TensorBoard events (gpipe.demo)
    flag_spellings   older spellings of the commands' flags, still taken
"""
