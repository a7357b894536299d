"""python -m gpipe.schedule: prints a schedule (gpipe.schedule.text)."""

import sys

from gpipe.schedule import text

if __name__ == '__main__':
  sys.exit(text.main())
