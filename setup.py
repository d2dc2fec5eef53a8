"""Build script: the pure-Python package plus one native extension, offload._C.

The extension is compiled from csrc/ with pybind11 and does not link against
libtorch (kernels take addresses and sizes), so building needs no torch. SIMD
kernels carry their own target attributes; nothing is built with -march=native.
If no compiler is found the package installs without the extension and every
feature falls back to a pure-PyTorch path (`offload report` says which).
"""
import glob
import hashlib
import os
import platform
import runpy
import shutil
import subprocess
import sys
import sysconfig

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

try:
    from pybind11.setup_helpers import Pybind11Extension
except ImportError:  # pybind11 missing: install the Python package alone.
    Pybind11Extension = None


# Note [native build cache]: pip builds in a fresh temporary directory each
# time, so every `pip install -e .` recompiled csrc/ (about 32 s on 2 cores)
# even when nothing changed. A built extension is kept under
# $OFFLOAD_BUILD_CACHE (default ~/.cache/offload/native), named by a hash of
# everything that decides its bytes: each file under csrc/, the compiler and
# its version, the flags, include directories (pybind11's version), the
# Python ABI and the machine. Any change is a new key, so a stale build is
# never reused. OFFLOAD_BUILD_CACHE=off builds every time;
# OFFLOAD_BUILD_CACHE_DEBUG=1 prints the parts of the key (to see why it missed).
def _cache_dir():
    where = os.environ.get("OFFLOAD_BUILD_CACHE", "")
    if where.lower() in ("off", "0", "no"):
        return None
    return where or os.path.join(os.path.expanduser("~"), ".cache", "offload", "native")


def _build_key(compiler, ext):
    h = hashlib.sha256()
    for path in sorted(glob.glob("csrc/**/*", recursive=True)):
        if os.path.isfile(path):
            h.update(path.encode() + b"\0")
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    command = list(getattr(compiler, "compiler_so", None) or [])
    try:
        version = subprocess.run(command[:1] + ["--version"], capture_output=True, text=True,
                                 timeout=30).stdout if command else ""
    except (OSError, subprocess.SubprocessError):
        version = "unknown"
    # pip builds in a fresh isolated environment each time, so pybind11's include
    # directory has a new temporary path every build: key it by pybind11's version.
    import pybind11

    includes = [f"pybind11-{pybind11.__version__}" if "pybind11" in d else d for d in ext.include_dirs]
    for part in (command, version, getattr(compiler, "linker_so", None), ext.extra_compile_args,
                 ext.extra_link_args, ext.define_macros, includes, ext.language,
                 sys.version, sysconfig.get_config_var("EXT_SUFFIX"), platform.machine(),
                 os.environ.get("CFLAGS"), os.environ.get("CXXFLAGS"), os.environ.get("LDFLAGS")):
        if os.environ.get("OFFLOAD_BUILD_CACHE_DEBUG"):
            sys.stderr.write(f"offload build key part: {part!r}\n")
        h.update(repr(part).encode() + b"\0")
    return h.hexdigest()[:32]


class OptionalBuildExt(build_ext):
    """Build the extension if possible; otherwise warn and continue.

    OFFLOAD_REQUIRE_NATIVE=1 turns a failed build into an error (CI sets it,
    so a broken kernel cannot hide behind the fallback). A build with the same
    inputs as an earlier one is copied from the cache (Note [native build cache]).
    """

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any compiler failure
            self._fail(exc)

    def build_extension(self, ext):
        try:
            self._build_or_reuse(ext)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _build_or_reuse(self, ext):
        cache = _cache_dir()
        if cache is None:
            return super().build_extension(ext)
        target = self.get_ext_fullpath(ext.name)
        cached = os.path.join(cache, _build_key(self.compiler, ext), os.path.basename(target))
        if os.path.isfile(cached):
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
            # shutil.copy, not copy2: the copy must be newer than any extension
            # already in the source tree, or an editable install keeps that one
            # (it copies only over an older file), e.g. after reverting csrc/.
            shutil.copy(cached, target)
            sys.stderr.write(f"offload: native extension unchanged, reused {cached}\n")
            return
        super().build_extension(ext)
        try:  # write then rename: a concurrent or killed build never leaves half a file
            os.makedirs(os.path.dirname(cached), exist_ok=True)
            partial = f"{cached}.{os.getpid()}.partial"
            shutil.copy2(target, partial)
            os.replace(partial, cached)
        except OSError as exc:  # a read-only home: build every time, say so once
            sys.stderr.write(f"offload: native build cache not written ({exc})\n")

    @staticmethod
    def _fail(exc):
        if os.environ.get("OFFLOAD_REQUIRE_NATIVE") == "1":
            raise exc
        sys.stderr.write(
            f"warning: offload native extension not built ({exc}); "
            "falling back to pure-PyTorch paths\n"
        )


# One list of runtime dependencies, shared with `offload report` (which checks
# them); loaded as a file so that building never imports offload or torch.
RUNTIME_REQUIREMENTS = runpy.run_path(os.path.join("offload", "requirements.py"))["install_requires"]()

ext_modules = []
if Pybind11Extension is not None:
    sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
    ext_modules.append(
        Pybind11Extension(
            "offload._C",
            sources,
            cxx_std=17,
            # -ffp-contract=off: GCC fuses a*b+c into one fma by default in C++,
            # which would change the Adam kernels' rounding (Note [bitwise
            # torch order]); the kernels place every fma themselves.
            extra_compile_args=["-O3", "-fno-math-errno", "-ffp-contract=off", "-pthread"],
            extra_link_args=["-pthread"],
            # dlopen/dlsym (csrc/adam/adam_vml.cpp looks up MKL's vsSqrt in the
            # torch library already loaded): in libc from glibc 2.34, libdl before.
            libraries=["dl"],
        )
    )

setup(
    name="offload",
    version="0.1.0",
    description="Memory-offload training engine for PyTorch: GPU, pinned host and NVMe tiers",
    long_description=open("README.md", encoding="utf-8").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # offload is the engine; offload_bench (benchmarks/offload_bench) is the `offload bench`
    # suite and the examples' GPT and corpus, installed beside it so a pip install can
    # benchmark without a checkout while `import offload` loads none of it.
    packages=find_packages(include=["offload", "offload.*"]) + ["offload_bench"],
    package_dir={"offload_bench": "benchmarks/offload_bench"},
    ext_modules=ext_modules,
    cmdclass={"build_ext": OptionalBuildExt},
    install_requires=RUNTIME_REQUIREMENTS,  # offload/requirements.py says what each is for
    extras_require={
        "bench": ["matplotlib"],
        # the Trainer/Accelerate/Lightning/PEFT tests, and the docs site's strict build
        "test": ["pytest", "transformers", "accelerate", "lightning", "peft", "bitsandbytes", "mkdocs",
                 "mkdocstrings[python]"],
        "docs": ["mkdocs", "mkdocstrings[python]"],
        "hf": ["transformers", "accelerate"],
        "peft": ["transformers", "accelerate", "peft"],  # examples/lora_finetune.py
        "qlora": ["transformers", "accelerate", "peft", "bitsandbytes"],  # a 4-bit base (partition/quantized.py)
    },
    entry_points={"console_scripts": ["offload=offload.cli:main"]},
)
