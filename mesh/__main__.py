"""`python -m mesh ...`: the `tandem` command (how `tandem up` starts each component)."""

import sys

from mesh.cli import main

sys.exit(main())
