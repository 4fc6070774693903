"""A/B of programmatic dependent launch (``config.programmatic_launch``) on the twell MLP op: off (A)
against on (B), outputs bit for bit equal. ``ab_kernel_setting.py`` with that setting.

    python examples/ab_programmatic_launch.py --m 1 16 4096 131072
"""

from __future__ import annotations

import sys

from ab_kernel_setting import main

if __name__ == "__main__":
    main(["--setting", "programmatic_launch", "--values", "0", "1", *sys.argv[1:]])
