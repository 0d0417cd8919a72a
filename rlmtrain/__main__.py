"""`python -m rlmtrain <command>` is `rlmtrain <command>`."""

import sys

from rlmtrain.cli import main

sys.exit(main())
