"""python -m offload.estimate ... (the same as `offload estimate ...`)."""
import sys

from offload.estimate.cli import main

sys.exit(main())
