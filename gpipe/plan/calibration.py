"""The planner's calibration: how fast the matrix units run, fitted on a run
that was measured.

The roofline charges a chip's matrix work at its peak; no chip sustains
that. One number, the matrix units' efficiency (the share of peak its dots
run at), is fitted so that the planned step of a published measured run
takes as long as the run did: MaxText's 16B on one TPU v5e-256 at its
published MFU (params/published_runs.py), planned as
`lm.MaxText16BOnV5e256` or, on fewer chips with its per-chip batch and
layout, `lm.MaxText16BOnV5e16`. Everything else stays as the roofline has
it: the elementwise work at peak, HBM traffic at its bandwidth, the
collectives by their bytes, hop latency and HBM traffic, hidden as far as
a schedule of the step at the fitted speed hides them
(gpipe.plan.overlap). The fit is a prediction only where it has been held
against other measurements: the three other published runs (32B, 64B,
128B), which `python -m benchmarks.calibration` plans with it, prints
beside their published MFU, and writes to docs/calibration.md.

    MATMUL_EFFICIENCY   the fitted figure every plan's calibrated step uses
    Fit(mfu_at, mfu)    the efficiency at which mfu_at(efficiency) = mfu
"""

# Fitted on lm.MaxText16BOnV5e16 (the 16B run's per-chip step and layout,
# FSDP over 16 chips, its collectives on the links its mesh had on the
# v5e pod) to its published MFU: `python -m benchmarks.calibration`
# (docs/calibration.md has the run and the runs it was held against).
MATMUL_EFFICIENCY = 0.763
FITTED_ON = ("MaxText's published 16B run on a v5e-256, planned as "
             'lm.MaxText16BOnV5e16')


def Fit(mfu_at, mfu, low=0.2, high=1.0, tolerance=1e-4):
  """The efficiency e in [low, high] with mfu_at(e) = mfu, by bisection
  (mfu_at grows with e: faster matrix units, a shorter step).

  Raises:
    ValueError: mfu is out of reach in [low, high] (the model's step is
      set by something else than its matrix work: say what instead).
  """
  at_low, at_high = mfu_at(low), mfu_at(high)
  if not at_low <= mfu <= at_high:
    raise ValueError(
        f'A measured MFU of {mfu:.4f} is out of reach: the planned step '
        f'gives {at_low:.4f} at an efficiency of {low} and {at_high:.4f} at '
        f'{high}; what sets it is not the matrix work.')
  while high - low > tolerance:
    middle = (low + high) / 2
    if mfu_at(middle) < mfu:
      low = middle
    else:
      high = middle
  return (low + high) / 2
