"""Test session set-up: quiet TF logs, report the largest numerical errors."""

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')


def pytest_terminal_summary(terminalreporter):
  """Prints the largest pipelined-vs-reference errors seen in this run."""
  import sys  # pylint: disable=g-import-not-at-top
  harness = sys.modules.get('tests.pipeline_harness')
  if harness is None:
    return
  errors = harness.LargestErrors()
  if errors['checks']:
    terminalreporter.write_line(
        f"pipelined vs reference: {errors['checks']} tensor comparisons, "
        f"largest abs error {errors['abs']:.3g}, largest rel error "
        f"{errors['rel']:.3g} (rel = |err| / max(|ref|, 1))")
