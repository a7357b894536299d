"""A model's whole training step as a function of tensors (internal): the
step the planner (gpipe.plan) compiles for N devices from shapes alone and
the partitioning check (gpipe.xla.check_model) runs, partitioned and on one
device.

    stacks       where a model keeps its pipelined stack (gpipe's layer, or
                 a Lingvo layer that builds it), and a candidate's reshaping
    train_step   the whole training step (forward, loss, backward, the
                 optimizer's update) as a function of tensors
    optimizers   the optimizer updates it runs (Lingvo's, as functions)
"""
