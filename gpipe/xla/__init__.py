"""XLA's SPMD partitioner on virtual CPU devices: the checks and the
planner's measurements (needs jax and jaxlib: the spmd extra).

    check_model       check_partitioning for a registered Lingvo model's
                      whole step
    user_layer        a user's PipelinedLayer Params for the checks: loaded
                      by name, checked against devices and inputs, the
                      check as a function
    partitioned_step  one training step partitioned and on one device, and
                      the report of what each device holds and sends
    partitioning      lowers a computation to HLO, partitions and compiles
                      (and runs) it for N virtual devices
    worker_pool       one spmd_worker process per device count, kept for
                      the next module
    dependencies      what may run beside each collective (its
                      computation's dependency graph), and its FLOPs
    reduce_scatters   which all-reduces are reduce-scatters (each device
                      reads only its part), as a TPU's compiler makes them
    hlo_text          reading the compiled module: loops, collectives
                      (how often each runs), buffers, op names
    widening          which collectives XLA:CPU widened from bfloat16 (a
                      TPU sends them at half the bytes)
    spmd_worker       the subprocess that partitions and compiles with
                      jaxlib
"""
