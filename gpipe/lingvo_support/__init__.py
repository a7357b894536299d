"""What gpipe needs of Lingvo around the layer (internal).

    registered_models  a registered model by name, or an error listing them
    tpu_build          layers built as for a TPU job, wherever they are
    variable_shardings a variable's own annotation (as a TPU keeps it),
                       read and put back on a tensor of it
    flags_and_seeds    Lingvo's flags parsed, step seeds, the caller's step
    lingvo_ops         Lingvo importable where its custom-op library
                       cannot load (pure-TF versions of the ops it uses)

The switch to gpipe's layer in Lingvo's own models is gpipe.lingvo_compat.
"""
