"""check's report: the summary table and the log files it leaves in $OUT.

Everything here reads what the stages left under the work folder (their
logs, the record plugin's files, train.json) and writes text; nothing runs.
The files are rewritten after every group of stages, so a run cut short still
leaves what it had (8 files at most: summary.txt, setup.log, tests.log,
bench.log, train_67m.json, train_1b.json, train_67m.png, train_1b.png).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

TEST_STAGES = ("cuda_tests", "suite")
KINDS = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
ROW = "{:<16} {:<12} {:>7} {:>7}  {}"


@dataclass
class Result:
    status: str  # pass, TIMEOUT, FAIL rc=N, skipped
    wall: int
    limit: int
    extra: str = ""  # why it was skipped


@dataclass
class CheckRun:
    """What the summary is made of: the work folder, the results so far, the plan's order."""
    work: Path
    out: str  # $OUT as given (the summary names it so)
    total_s: int
    t0: float
    env_line: str
    order: list[str] = field(default_factory=list)
    results: dict[str, Result] = field(default_factory=dict)

    def log(self, name: str) -> Path:
        return self.work / "logs" / f"{name}.log"

    def record(self, name: str) -> Path:
        return self.work / "logs" / f"{name}.record"


# ------------------------------------------------------------------ text helpers
def read(path: Path) -> str:
    """A file's text, whatever its bytes (a log cut mid-character still reads)."""
    return Path(path).read_bytes().decode("utf-8", errors="replace")


def nonempty(path: Path) -> bool:
    return Path(path).is_file() and Path(path).stat().st_size > 0


def last_lines(text: str, n: int) -> str:
    """The last n lines, ending in a newline (a log killed mid-line does not)."""
    lines = re.findall(r"[^\n]*\n|[^\n]+$", text)[-n:] if n > 0 else []
    out = "".join(lines)
    return out if not out or out.endswith("\n") else out + "\n"


# ------------------------------------------------------------------ the test stages' record
def record_rows(path: Path) -> list[list[str]]:
    """The record plugin's lines, KIND<TAB>NODEID<TAB>WHEN (or collected<TAB>N), split."""
    return [parts for parts in (line.split("\t") for line in read(path).split("\n")) if len(parts) >= 2]


def finished_counts(record: Path, log: Path) -> str:
    """'60 of 412 tests finished: 55 passed, 3 failed, ...' from the record, or
    from pytest's progress letters where there is no record (the plugin did not load)."""
    if nonempty(record):
        total, seen, had, counts = "", set(), set(), Counter()
        for kind, nodeid, *_ in record_rows(record):
            if kind == "collected":
                total = total or nodeid  # the first collection's count
                continue
            seen.add(nodeid)
            if (kind, nodeid) not in had:  # a test reported twice (a rerun, an error at teardown) counts once
                had.add((kind, nodeid))
                counts[kind] += 1
        said = ", ".join(f"{counts[k]} {k}{'s' if k == 'error' and counts[k] > 1 else ''}" for k in KINDS if counts[k])
        return f"{len(seen)}{f' of {total}' if total else ''} tests finished{f': {said}' if said else ''}"
    if Path(log).is_file():
        letters = [re.sub(r" *\[.*$", "", line) for line in read(log).split("\n")
                   if re.fullmatch(r"[.FEsxX]+ *(\[ *[0-9]+%\])?", line)]
        return f"{len(''.join(letters))} tests finished (counted from pytest's progress letters)"
    return ""


def failed_ids(record: Path) -> list[str]:
    """Each failed or erroring test once, in the order it happened."""
    if not nonempty(record):
        return []
    out, seen = [], set()
    for kind, nodeid, *rest in record_rows(record):
        if kind in ("failed", "error") and nodeid not in seen:
            seen.add(nodeid)
            out.append(f"FAILED {nodeid}" if kind == "failed" else f"ERROR  {nodeid} (at {rest[0] if rest else ''})")
    return out


def failed_lines(record: Path, most: int) -> list[str]:
    """The summary's lines under a test stage's row."""
    ids = failed_ids(record)
    lines = [f"    {i}" for i in ids[:most]]
    if len(ids) > most:
        lines.append(f"    ... and {len(ids) - most} more: tests.log names them all")
    return lines


# ------------------------------------------------------------------ each stage's row
def bench_detail(train_json: Path) -> str:
    """'0.94B params, batch 8 x seq 1024: 3 ok, 0 failed, 2 skipped'."""
    try:
        r = json.loads(read(train_json))
        res = r["results"]
        ok = sum("median_s" in v for v in res.values())
        skip = sum(bool(v.get("skipped")) for v in res.values())
        n = r["params"]
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n}"
        return (f"{size} params, batch {r['settings']['batch']} x seq {r['settings']['seq']}: "
                f"{ok} ok, {len(res) - ok - skip} failed, {skip} skipped")
    except Exception:  # no train.json, or one cut short: the row says nothing more
        return ""


def detail(run: CheckRun, name: str) -> str:
    """What a stage's row says besides pass/fail: test counts, op times, medians."""
    log = run.log(name)
    if not log.is_file():
        return ""
    text = read(log)
    lines = text.split("\n")
    if name in TEST_STAGES:
        hits = [line for line in lines if re.search(
            r"[0-9]+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed)|no tests ran", line)]
        return re.sub(r" =+$", "", re.sub(r"^=+ ", "", hits[-1])) if hits else ""
    if name == "setup_deepspeed":
        hits = [line for line in lines if re.match(r"deepspeed [0-9]", line)]
        return " ".join(hits[-1].split(" ")[:2]) if hits else ""
    if name == "setup_project":
        return "offload._C built" if "offload._C built" in text else ""
    if name == "setup_ds_ops":
        hits = [line for line in lines if re.search(r"^op .* built and loaded|has no such op|not compatible", line)]
        return "; ".join(re.sub(r" built and loaded in ", " ", re.sub(r"^op ", "", h)) for h in hits)
    if name.startswith("bench_"):
        return bench_detail(run.work / name / "train.json")
    return ""


def contender_lines(train_json: Path) -> list[str]:
    """One line per contender under a bench stage's row."""
    try:
        r = json.loads(read(train_json))
        out = []
        for name, v in r["results"].items():
            if "median_s" in v:
                line = (f"{v['median_s']:.3f} s/step (median of {len(v['step_times_s'])}), "
                        f"{v['tokens_per_s']:.0f} tok/s, {v['tflops']:.3g} TFLOPS, "
                        f"RSS {v['peak_rss_bytes'] / 2**30:.1f} GiB")
                if "peak_gpu_bytes" in v:
                    line += f", GPU {v['peak_gpu_bytes'] / 2**30:.1f} GiB"
                out.append(f"    {name:<16} ok    {line}")
            else:
                state = "skip" if v.get("skipped") else "FAIL"
                out.append(f"    {name:<16} {state}  {str(v.get('error'))[:110]}")
        return out
    except Exception:
        return []


def row(run: CheckRun, name: str) -> list[str]:
    """A stage's row of the table and the lines under it."""
    r = run.results[name]
    status, extra = r.status, r.extra or detail(run, name)
    if name in TEST_STAGES and (status == "TIMEOUT" or not extra):
        # a test stage cut short (no closing line of pytest's): what its record says
        extra = finished_counts(run.record(name), run.log(name))
    if status == "TIMEOUT":
        extra = f"stopped at its {r.limit} s limit" + (f"; {extra}" if extra else "")
    if name.startswith("bench_") and status == "FAIL rc=1" and re.search(r", 0 failed, [1-9]", extra):
        status = "partial"  # its only misses are contenders skipped for time
    lines = [ROW.format(name, status, r.wall, r.limit, extra)]
    if name.startswith("bench_"):
        lines += contender_lines(run.work / name / "train.json")
    elif name in TEST_STAGES:
        lines += failed_lines(run.record(name), 15)
    return lines


def summary(run: CheckRun, now: float | None = None) -> str:
    """The table printed last and written to summary.txt."""
    now = time.time() if now is None else now
    lines = [f"== gpu-check summary ({time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(now))}) ==",
             run.env_line, ROW.format("stage", "status", "wall_s", "limit_s", "counts / medians")]
    for name in run.order:
        if name in run.results:  # a stage planned but not reached has no row yet
            lines += row(run, name)
    files = sorted(set(os.listdir(run.out)) | {"summary.txt"}) if os.path.isdir(run.out) else ["summary.txt"]
    lines.append(f"total: {int(now) - int(run.t0)} s of the {run.total_s} s budget; "
                 f"files in {run.out}: {' '.join(files)}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ the log files
def tail_section(title: str, path: Path, n: int) -> str:
    if not Path(path).is_file():
        return ""
    text = read(path)
    return f"===== {title} (last {n} lines of {text.count(chr(10))}) =====\n" + last_lines(text, n)


def test_section(run: CheckRun, name: str) -> str:
    """tests.log's part for a test stage: its counts, its failures as they happened, its log's end."""
    log, record = run.log(name), run.record(name)
    if not log.is_file():
        return ""
    status = run.results[name].status if name in run.results else "running"
    out = [f"===== {name}: {status}; {finished_counts(record, log)} =====\n"]
    if nonempty(record):
        ids = failed_ids(record)
        out.append(f"--- failed or erroring, in the order they happened ({len(ids)}) ---\n")
        out += [f"{i}\n" for i in ids[:200]]
        if len(ids) > 200:
            out.append(f"... and {len(ids) - 200} more ({record} on the machine)\n")
        reports = Path(f"{record}.reports")
        if nonempty(reports):
            out.append("--- the first 15 of their reports, as they happened ---\n")
            k = 0
            for line in re.findall(r"[^\n]*\n|[^\n]+$", read(reports)):
                k += bool(re.match(r"----- (FAILED|ERROR) ", line))
                if k <= 15:
                    out.append(line)
    text = read(log)
    out.append(f"--- the log's last 200 lines (of {text.count(chr(10))}) ---\n")
    out.append(last_lines(text, 200))
    return "".join(out)


def publish(run: CheckRun) -> None:
    """Copies what there is so far to $OUT."""
    out = Path(run.out)
    (out / "setup.log").write_text("".join(tail_section(n, run.log(n), 120)
                                           for n in ("setup_deepspeed", "setup_project", "setup_ds_ops")))
    (out / "tests.log").write_text("".join(test_section(run, n) for n in TEST_STAGES))
    (out / "bench.log").write_text("".join(tail_section(n, run.log(n), 250) for n in ("bench_67m", "bench_1b")))
    for b in ("67m", "1b"):
        for ext in ("json", "png"):
            src = run.work / f"bench_{b}" / f"train.{ext}"
            if src.is_file():
                shutil.copyfile(src, out / f"train_{b}.{ext}")
    (out / "summary.txt").write_text(summary(run))
