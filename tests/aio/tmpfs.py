"""A real, small tmpfs for tests that need the kernel's own ENOSPC (root only)."""
import contextlib
import os
import subprocess

import pytest

IS_ROOT = os.geteuid() == 0


@contextlib.contextmanager
def mounted_tmpfs(tmp_path, size: str, why_skip: str):
    """Mounts a tmpfs of `size` (mount's syntax: 400k, 1m) at tmp_path/mnt for
    the block; skips the test, saying `why_skip`, where mounting is not allowed."""
    if not IS_ROOT:
        pytest.skip(f"mounting a tmpfs needs root; {why_skip}")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("mount -t tmpfs not permitted here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
