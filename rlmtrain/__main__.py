"""`python -m rlmtrain <command>` is `rlmtrain <command>`; under torchrun,
`torchrun --nproc_per_node N -m rlmtrain train ...` runs one rank of a training run."""

import os
import sys

from rlmtrain.cli import main

if "TORCHELASTIC_ERROR_FILE" in os.environ:
    # Launched by torchrun: elastic's `record` writes a failing rank's traceback where torchrun
    # reports it; torchrun then stops the other ranks.
    from torch.distributed.elastic.multiprocessing.errors import record

    main = record(main)

sys.exit(main())
