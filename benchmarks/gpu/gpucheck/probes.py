"""What the checks ask of the Python under test (GPU_CHECK_PYTHON), run as a
script in it: `python probes.py gpu|env|device|op NAME`.

The driver itself needs only the standard library; torch and DeepSpeed are
imported here, in the interpreter the stages use, never in the driver. This
file imports nothing of the gpucheck package.
"""
import platform
import sys
import time


def gpu() -> int:
    """The GPU's name, or why there is none (exit 1): check's preflight."""
    try:
        import torch
    except Exception as exc:
        print(f"torch does not import in {sys.executable} ({type(exc).__name__}: {exc})")
        return 1
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        print(f"CUDA is not available: torch {torch.__version__} ({build}) in {sys.executable} sees no GPU")
        return 1
    print(torch.cuda.get_device_name())
    return 0


def env() -> int:
    """check's summary line: the Python and torch versions."""
    import torch

    print(f"python {platform.python_version()}, torch {torch.__version__}")
    return 0


def device() -> int:
    """step's summary header: torch's version and the GPU, if any."""
    import torch

    print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
    return 0


def cuda_home() -> int:
    """The CUDA toolkit torch builds extensions with (its stubs serve a -lcuda link)."""
    from torch.utils.cpp_extension import CUDA_HOME

    print(CUDA_HOME or "")
    return 0


def op(name: str) -> int:
    """Builds and loads one of DeepSpeed's ops (CPUAdamBuilder, AsyncIOBuilder), as
    the DeepSpeed contenders will load it: setup_ds_ops runs one process per op so
    their compiles overlap; torch keeps them under its extensions folder."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    builder = acc.create_op_builder(name)
    if builder is None:
        print(f"{name}: accelerator {acc.device_name()} has no such op", file=sys.stderr)
        return 1
    t = time.perf_counter()
    if not builder.is_compatible(verbose=True):
        print(f"{name}: not compatible here (see the warnings above)", file=sys.stderr)
        return 1
    builder.load(verbose=False)
    print(f"op {builder.NAME}: built and loaded in {time.perf_counter() - t:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    sys.exit({"gpu": gpu, "env": env, "device": device, "cuda_home": cuda_home, "op": op}[what](*args))
