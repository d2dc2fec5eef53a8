"""`offload bench ...` as a new user meets it: where the files go, what is left
behind, and what is said when matplotlib is missing. Every run is a subprocess
in tmp_path, so no bench_out/ appears in the checkout, at the smallest sizes."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The smallest run of each benchmark that still writes its JSON and PNG.
QUICK = {
    "adam": ["--quick", "--sizes", "1000", "--repeats", "1", "--warmup", "0", "--no-deepspeed"],
    "io": ["--quick", "--size", "8Mi", "--no-sweep", "--no-fio", "--no-deepspeed", "--backends", "threads",
           "--path", "disk"],
    "train": ["--quick", "--contenders", "torch", "--warmup", "0", "--steps", "1"],
}
PNG = {"adam": "cpu_adam.png", "io": "io.png", "train": "train.png"}


def _bench(cwd, name, *args, path_first=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [path_first, str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "offload", "bench", name, *QUICK[name], *args],
                          capture_output=True, text=True, env=env, timeout=300, cwd=cwd)


def _direct_io_works(directory: Path) -> bool:
    """The io benchmark needs O_DIRECT where it writes (tmpfs refuses it)."""
    probe = directory / "direct-probe"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_WRONLY | getattr(os, "O_DIRECT", 0), 0o600))
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


@pytest.fixture
def no_matplotlib(tmp_path):
    """A directory to put first on PYTHONPATH: a matplotlib that fails to import, as a missing one does."""
    stand_in = tmp_path / "stand-in"
    (stand_in / "matplotlib").mkdir(parents=True)
    (stand_in / "matplotlib" / "__init__.py").write_text(
        "raise ImportError('No module named matplotlib (test stand-in)')\n")
    return str(stand_in)


@pytest.mark.parametrize("name", [pytest.param("adam", marks=pytest.mark.slow), "io",
                                  pytest.param("train", marks=pytest.mark.slow)])
def test_a_missing_matplotlib_is_one_line_naming_the_png_and_the_install(tmp_path, no_matplotlib, name):
    if name == "io" and not _direct_io_works(tmp_path):
        pytest.skip("no O_DIRECT on the temporary directory's filesystem")
    work = tmp_path / "work"
    work.mkdir()
    proc = _bench(work, name, path_first=no_matplotlib)
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "matplotlib" in line]
    assert said == [f"{PNG[name]} not written: matplotlib is not installed "
                    '(pip install matplotlib, or pip install -e ".[bench]" from a checkout)'], proc.stderr
    out = work / "bench_out"
    assert not (out / PNG[name]).exists()
    assert json.loads(proc.stdout)["benchmark"] in ("cpu_adam", "io", "train")
    assert (out / f"{PNG[name].removesuffix('.png')}.json").is_file()  # the JSON is written all the same


@pytest.mark.slow
def test_io_writes_under_bench_out_and_removes_the_directory_it_made(tmp_path):
    if not _direct_io_works(tmp_path):
        pytest.skip("no O_DIRECT on the temporary directory's filesystem")
    proc = _bench(tmp_path, "io")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_out"]  # disk/ made and removed
    report = json.loads((tmp_path / "bench_out" / "io.json").read_text())
    assert report == json.loads(proc.stdout)
    assert report["contenders"]["threads"]["write"] > 0 and report["contenders"]["threads"]["read"] > 0
    assert report["path"] == str((tmp_path / "disk").resolve())
    # The 8 MiB file is streamed through one buffer no larger than the file.
    assert report["settings"]["buffer_bytes"] == 8 << 20
    assert report["peak_rss_bytes"] > 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert report["png"] == "bench_out/io.png" and (tmp_path / "bench_out" / "io.png").is_file()


def _baseline_rss(cwd) -> int:
    """Peak RSS of a process that has imported what the io benchmark imports and
    made one small aligned buffer (pinned, so CUDA is started, where there is one)."""
    code = ("import offload.aio, offload_bench.io\n"
            "from offload_bench.common import peak_rss_bytes, pyplot\n"
            "offload.aio.aligned_empty(4096); pyplot('x.png'); print(peak_rss_bytes())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.split()[-1])


@pytest.mark.slow
def test_io_leaves_a_given_directory_as_it_found_it_and_stays_within_its_buffer(tmp_path):
    if not _direct_io_works(tmp_path):
        pytest.skip("no O_DIRECT on the temporary directory's filesystem")
    disk = tmp_path / "disk"
    disk.mkdir()
    (disk / "mine.txt").write_text("the user's\n")
    proc = _bench(tmp_path, "io", "--out", "results", "--size", "256Mi")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in disk.iterdir()) == ["mine.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "results"]
    report = json.loads((tmp_path / "results" / "io.json").read_text())
    # Streamed through two 64 MiB halves, never the 256 MiB file whole (which,
    # with the temporary its random contents were drawn into, took 2 x 256 MiB).
    assert report["settings"]["chunk"] == 64 << 20 and report["settings"]["buffer_bytes"] == 128 << 20
    budget = _baseline_rss(tmp_path) + report["settings"]["buffer_bytes"] + (64 << 20)  # + the threads' stacks,
    assert report["peak_rss_bytes"] < budget, (report["peak_rss_bytes"], budget)     # the plot, the JSON


def test_stream_covers_the_file_in_order_two_requests_at_most(tmp_path):
    """_stream's requests: every byte once, in offset order, alternating halves, two in flight."""
    import torch

    from offload_bench import io

    class Request:
        def __init__(self, log, t, offset):
            self.log, self.t, self.offset = log, t, offset
            log["in_flight"] += 1
            log["most"] = max(log["most"], log["in_flight"])

        def wait(self):
            self.log["in_flight"] -= 1

    log = {"in_flight": 0, "most": 0, "calls": []}
    buf = torch.zeros(2 * 4096 * 3, dtype=torch.uint8)

    def submit(t, path, offset):
        log["calls"].append((t.data_ptr() - buf.data_ptr(), t.numel(), offset))
        return Request(log, t, offset)

    nbytes = 5 * 4096 * 3 + 100  # five whole chunks and a short tail
    io._stream(submit, buf, tmp_path / "f", nbytes, chunk=4096 * 3)
    chunk = 4096 * 3
    assert log["calls"] == [((i % 2) * chunk, min(chunk, nbytes - i * chunk), i * chunk) for i in range(6)]
    assert log["most"] == 2 and log["in_flight"] == 0


def test_chunks_let_every_worker_fill_its_queue_and_stay_aligned():
    from offload_bench import io

    assert io._chunk_bytes(1 << 20, 32, 1, 1 << 30) == io.CHUNK_MIN
    assert io._chunk_bytes(4 << 20, 64, 2, 1 << 30) == 512 << 20  # block x depth x parallelism
    assert io._chunk_bytes(4 << 20, 64, 2, 256 << 20) == 256 << 20  # never more than the transfer
    assert io._chunk_bytes(100_000, 1000, 1, 1 << 30) % 4096 == 0
    assert io._buffer_bytes(64 << 20, 1 << 30) == 128 << 20
    assert io._buffer_bytes(256 << 20, 256 << 20) == 256 << 20


def test_the_engine_package_loads_no_benchmark_or_example_code():
    # offload_bench ships beside offload (for `offload bench` without a checkout);
    # importing the engine must not pull it, or its GPT and corpus, in.
    code = ("import sys, offload, offload.engine, offload.checkpoint_io\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('offload_bench', 'matplotlib')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    import offload_bench

    assert Path(offload_bench.__file__).resolve().parent == ROOT / "benchmarks" / "offload_bench"
