"""python -m offload.sizing ... (the same as `offload estimate ...`)."""
import sys

from offload.sizing.cli import main

sys.exit(main())
