#!/usr/bin/env bash
# Fetches, on a machine WITH network (a developer's), what the lent GPU machine
# lacks for benchmarks/gpu/check.sh, into .gpu-check/ at the repository root
# (ignored by git; the device call carries it: carry [".gpu-check"]):
#
#   .gpu-check/wheels/  DeepSpeed 0.19.8's sdist and its runtime dependencies
#                       as CPython 3.12 manylinux x86_64 wheels (the image is
#                       Python 3.12 with torch 2.11.0+cu130 but no hjson or
#                       pydantic, and too old a typing-extensions). Never torch,
#                       numpy or an nvidia-* / CUDA wheel: the image has those.
#                       Also py-libaio (PyPI `libaio`, `import libaio`), a
#                       runtime dependency of the project (offload/requirements.py)
#                       that the image lacks: PyPI has no binary wheel of it, only
#                       an sdist of pure Python (ctypes over libaio.so.1), built
#                       here into a py3-none-any wheel, which CPython 3.12 takes.
#   .gpu-check/debs/    libaio (runtime + headers) as Debian .debs, unpacked on
#                       the GPU machine under /tmp with dpkg -x, so that
#                       DeepSpeed's async_io op can build (the image has no
#                       libaio.h).
#
# Idempotent: what is already there is not fetched again. Prints the folder's
# size last; the device call carries at most 64 MiB in all (working tree
# included), so this must stay a few MiB.
#
#   bash benchmarks/gpu/fetch.sh        # from the repository root
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.gpu-check
mkdir -p "$dest/wheels" "$dest/debs"
PY=${PYTHON:-python3}
# pip, less the warnings this machine's pip configuration prints for each
# local index folder a package is not in
pip_() { "$PY" -m pip "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2); }

DS_VERSION=0.19.8
# DeepSpeed 0.19.8's requirements/requirements.txt: einops hjson msgpack ninja
# numpy packaging psutil py-cpuinfo pydantic>=2 torch tqdm. numpy and torch are
# left out on purpose (the image has them; numpy alone is ~16 MiB). pydantic
# brings pydantic-core, annotated-types, typing-extensions, typing-inspection.
DEPS=(hjson pydantic einops msgpack ninja packaging psutil py-cpuinfo tqdm typing-extensions)

if ls "$dest/wheels/deepspeed-$DS_VERSION.tar.gz" >/dev/null 2>&1; then
  echo "fetch: deepspeed-$DS_VERSION.tar.gz already there"
else
  # the sdist alone (pip prepares its metadata in an isolated build environment)
  pip_ download -q --no-deps --no-binary :all: \
    "deepspeed==$DS_VERSION" -d "$dest/wheels"
fi

# py-libaio: the version check.sh installs (offload/requirements.py asks >=0.9).
LIBAIO_VERSION=0.9.5

# CPython 3.12 on manylinux x86_64: the wheels pip may take for the image
plat=()
for p in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux_2_12_x86_64 manylinux2010_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
  plat+=(--platform "$p")
done

missing=()
for d in "${DEPS[@]}"; do
  # wheel file names use underscores for dashes
  stem=${d//-/_}
  # shellcheck disable=SC2010  # wheel names: no odd characters
  ls "$dest/wheels/" | grep -qi "^${stem}-" || missing+=("$d")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "fetch: the dependency wheels are already there"
else
  echo "fetch: downloading wheels for CPython 3.12 manylinux x86_64: ${missing[*]} (and their dependencies)"
  # Resolved with their dependencies, then anything that is torch, numpy or
  # CUDA is refused (none should come: no package listed depends on them).
  pip_ download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    "${plat[@]}" -d "$dest/wheels" "${missing[@]}"
fi
if ls "$dest/wheels/libaio-$LIBAIO_VERSION-"*.whl >/dev/null 2>&1; then
  echo "fetch: the py-libaio $LIBAIO_VERSION wheel is already there"
else
  # A CPython 3.12 manylinux wheel where PyPI has one (none up to 0.9.5: an sdist
  # only), else the sdist built here into a wheel. py-libaio is pure Python
  # (ctypes over the system's libaio.so.1), so that wheel is py3-none-any and
  # serves the image's 3.12 as it is; a build that came out tied to this
  # machine's Python (a compiled part in a later release) is refused.
  if pip_ download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
       "${plat[@]}" -d "$dest/wheels" "libaio==$LIBAIO_VERSION" 2>/dev/null; then
    echo "fetch: py-libaio $LIBAIO_VERSION: PyPI's wheel for CPython 3.12"
  else
    echo "fetch: py-libaio $LIBAIO_VERSION: PyPI has no CPython 3.12 wheel; building one here from its sdist"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    pip_ download -q --no-deps --no-binary=:all: "libaio==$LIBAIO_VERSION" -d "$tmp/sdist"
    pip_ wheel -q --no-deps "$tmp"/sdist/libaio-"$LIBAIO_VERSION".tar.gz -w "$tmp/wheel"
    built=$(cd "$tmp/wheel" && ls libaio-"$LIBAIO_VERSION"-*.whl)
    case $built in
      *-none-any.whl) mv "$tmp/wheel/$built" "$dest/wheels/" ;;
      *) echo "fetch: py-libaio $LIBAIO_VERSION built as $built, not pure Python: it would not fit the image's CPython 3.12" >&2
         exit 1 ;;
    esac
  fi
fi

# shellcheck disable=SC2010  # wheel names: no odd characters
bad=$(ls "$dest/wheels" | grep -i -E '^(torch|numpy|nvidia|triton|cuda)' || true)
if [ -n "$bad" ]; then
  echo "fetch: refusing to carry these (the image has them): $bad" >&2
  # shellcheck disable=SC2086  # one name a line, none with a space
  (cd "$dest/wheels" && rm -f $bad)
fi

if ls "$dest"/debs/libaio-dev_*.deb >/dev/null 2>&1 && ls "$dest"/debs/libaio1*.deb >/dev/null 2>&1; then
  echo "fetch: the libaio .debs are already there"
else
  stamp=/tmp/.gpu-check-apt-updated
  if [ ! -e "$stamp" ]; then
    apt-get update -qq && touch "$stamp"
  fi
  # Debian bookworm calls the runtime libaio1, trixie and Ubuntu 24.04 libaio1t64.
  runtime=libaio1t64
  apt-cache show "$runtime" >/dev/null 2>&1 || runtime=libaio1
  (cd "$dest/debs" && apt-get download -q libaio-dev "$runtime")
fi

echo "fetch: contents of $dest:"
(cd "$dest" && find . -type f | sort | while read -r f; do
  printf '  %8s  %s\n' "$(du -k "$f" | cut -f1)K" "${f#./}"
done)
size_kib=$(du -sk "$dest" | cut -f1)
echo "fetch: $dest is $((size_kib / 1024)).$(( (size_kib % 1024) * 10 / 1024 )) MiB (the device call carries 64 MiB at most, working tree included)"
if [ "$size_kib" -gt $((16 * 1024)) ]; then
  echo "fetch: $dest is over 16 MiB: something unexpected was fetched" >&2
  exit 1
fi
