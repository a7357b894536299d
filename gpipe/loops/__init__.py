"""The loops' machinery under gpipe.recurrent (internal): while loops, the
traced cell they run, what the backward pass stores. It knows no
schedule: only remat's policies name stage-shaped data (a stage's slice of
the stacked weights is recomputed, never stored), and no microbatches.

    while_loops    while loops of exactly n iterations, XLA-friendly
    compiled_loops a loop a Session runs as one XLA computation; whether
                   the graph being built is XLA's (UnderXla)
    cell_graph     one iteration and its gradient, traced once and imported
                   into the loops
    graph_import   importing what a loop needs of the cell, values fed
    remat          what the backward pass stores and what it recomputes
    deferred_dots  weight gradients of dots over few examples summed once
                   after the backward loop
    tensor_lists   the [T, ...] results a loop fills entry by entry
    kept_extras    where each iteration's extras are kept (Kept) and their
                   gradients come from
    made_after     values a scheduler cannot compute before a given tensor
"""
