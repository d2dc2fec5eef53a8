"""python3 benchmarks/gpu/gpucheck check | step | stage NAME

`check` and `step` are what check.sh and step_check.sh run; `stage NAME` is
one of check's stages, started by check itself in a process of its own.
"""
import sys
from pathlib import Path

if not __package__:  # run as a folder (python3 benchmarks/gpu/gpucheck): import the package by its name
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from gpucheck import check, stages, step  # noqa: E402  (after the path is set)


def main(argv: list[str]) -> int:
    if argv[:1] == ["check"] and len(argv) == 1:
        return check.main()
    if argv[:1] == ["step"] and len(argv) == 1:
        return step.main()
    if argv[:1] == ["stage"] and len(argv) == 2 and argv[1] in stages.STAGES:
        return stages.main(argv[1])
    print(__doc__.strip(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
