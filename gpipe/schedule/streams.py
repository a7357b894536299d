"""Where stream_io keeps each microbatch: the layout and order of
gpipe.pipeline.streamed_io's streams, in pure Python.

It reads a gpipe.schedule.Schedule passed in and imports nothing of gpipe,
so that it loads on its own, as the schedule's arithmetic does (its tests
load both from their files, without the gpipe package).
"""

__all__ = [
    'Streams',
]


class Streams:
  """Where stream_io keeps each microbatch
  (gpipe.pipeline.streamed_io.StreamedIo).

  A stream holds the [M, ...] inputs (outputs, their gradients) split over
  the stages as [K, S, ...], K = ceil(M / S): stage s keeps microbatches
  s K .. s K + K - 1, entry k holding s K + k; column k, entry k of every
  stage, holds microbatches k, K + k, 2 K + k, ... from stage 0 up. The
  pipeline takes them in order at stage 0 (and gives them back in order at
  the last stage) by rotating one column, [S] entries, by one stage at a
  time.
  """

  def __init__(self, schedule: 'Schedule'):
    self.schedule = schedule

  @property
  def num_columns(self):
    """K: the stream's columns; microbatches each stage keeps."""
    return -(-self.schedule.num_microbatches // self.schedule.num_stages)

  @property
  def padded_microbatches(self):
    """S K: the stream's entries, padded past M."""
    return self.num_columns * self.schedule.num_stages

  def Column(self, microbatch):
    """The column that holds `microbatch`."""
    return microbatch % self.num_columns

  def WritesPerColumn(self, column):
    """How many of the M microbatches column `column` holds."""
    return len(range(column, self.schedule.num_microbatches,
                     self.num_columns))

  def FixupShifts(self):
    """Per column, the extra rotations a written stream needs at the end:
    a column written n < S times sits n places short of its home."""
    s = self.schedule.num_stages
    return [(s - self.WritesPerColumn(k)) % s for k in range(self.num_columns)]

  def ReadColumns(self):
    """Per forward iteration, the column stage 0 reads (-1: none): its
    microbatch's where its row says first_layer."""
    return [self.Column(row[0].microbatch) if row[0].first_layer else -1
            for row in self.schedule.Rows()]

  def WriteColumns(self):
    """Per forward iteration, the column the last stage's output goes to
    (-1: none): its microbatch's where its row says last_layer."""
    return [self.Column(row[-1].microbatch) if row[-1].last_layer else -1
            for row in self.schedule.Rows()]
