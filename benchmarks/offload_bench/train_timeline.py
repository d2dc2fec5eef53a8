"""Each timed step of ours, from the engine's timeline: where its wall time went.

Note [critical path]
engine.timeline() (Note [timeline] in offload/timeline.py) gives the last
complete step's spans: forward, backward, read, write, optimizer, wait, each
with its thread. Read after every timed step, it gives that step. Sums of
spans per kind overlap (reads in flight beside compute, updates on the
optimizer threads beside backward), so they are kept as they are and, beside
them, the compute thread's time is split into parts that do not overlap and
add up to the step's wall time:
  wait        the compute thread blocked (a wait span): a parameter read
              prefetch did not hide, the optimizer backlog, step() waiting for
              the overlapped updates
  optimizer   Adam updates on the compute thread, less the waits inside them
  compute     forward and backward, less the waits and updates inside them
  other       the rest of the window: Python between the spans (the loss,
              the engine's bookkeeping around them)
Inner spans win (a wait inside a forward counts as wait), so no second of
the window is counted twice. Host<->device copies are not timeline spans; on
--device sim the device layer's schedule gives them per step (copies).
"""
from __future__ import annotations

import statistics

# What each field of a step in "timeline_per_step" means; train.json carries it as
# "timeline_per_step_doc" and the --help epilog quotes it.
TIMELINE_PER_STEP_DOC = {
    "step_s": "the step as the benchmark timed it (forward, loss, backward, optimizer step)",
    "wall_s": "the engine's step window: first forward to the end of the optimizer step",
    "compute_s": "forward + backward host time on the compute thread (waits inside them included)",
    "wait_s": "the compute thread blocked: reads prefetch did not hide, the optimizer backlog, step() "
              "waiting for overlapped updates",
    "optimizer_s": "Adam update time summed over threads (on the optimizer threads beside backward "
                   "when overlapped, else on the compute thread)",
    "optimizer_on_compute_s": "the part of optimizer_s run on the compute thread",
    "read_s": "NVMe read spans summed, submission to observed completion (they overlap compute and "
              "each other)",
    "write_s": "NVMe write spans summed, as read_s",
    "reads": "NVMe reads in the step",
    "writes": "NVMe writes in the step",
    "copies": "--device sim: host<->device copies in the step (copies_busy_s: their union; "
              "copies_exposed_s: the part with compute blocked)",
    "bus": "bytes up (host -> device) and down the bus in the step, counted by the device layer; "
           "on cuda also the seconds those copies took each way (CUDA events around each copy, "
           "summed: one stream each way, so the time that way was busy). bus_rate_gbps beside "
           "timeline_per_step is a 1 GiB pinned copy's rate each way, for the floor bytes / rate",
    "optimizer_gparams_per_s": "trainable parameters / optimizer_s: the optimizer's rate inside the step",
    "modeled_compute_s": "--device sim with OFFLOAD_SIM_TFLOPS: the device compute's modeled time "
                         "in the step (Note [sim modeled compute] in offload/device/sim_compute.py)",
    "waits": "wait_s by where the compute thread waited: forward_reads_s and backward_reads_s (a "
             "parameter's read prefetch did not hide), backlog_s (a gradient hook held until the "
             "overlapped updates caught up), after_backward_s (step() waiting for the updates still "
             "running)",
    "critical_path": "the compute thread's wall_s split into parts that do not overlap: compute_s, "
                      "wait_s, optimizer_s (on the compute thread) and other_s (the rest: Python "
                      "between spans, the loss); inner spans win (Note [critical path])",
}

_CRITICAL = ("forward", "backward", "optimizer", "wait")


def critical_path(tl: dict, step_s: float | None = None, sim: dict | None = None) -> dict:
    """One step's figures from engine.timeline() (Note [critical path]); `sim` is the
    step's train_contenders._sim_overlap, whose host<->device copies it adds."""
    from offload.device import hidden_time

    wall = tl["wall_s"]
    window = [(0.0, wall)]
    sec = tl["seconds"]
    on_compute = [s for s in tl["spans"] if s["thread"] == "compute" and s["kind"] in _CRITICAL]

    def clipped(*kinds):  # the compute thread's spans of these kinds, within the window
        spans = [(s["start_s"], s["start_s"] + max(s["seconds"], 0.0)) for s in on_compute if s["kind"] in kinds]
        return hidden_time.intersect(spans, window)

    def minus(a, b):  # seconds of a not covered by b
        return float(hidden_time.length(a) - hidden_time.length(hidden_time.intersect(a, b)))

    waits, updates, model = clipped("wait"), clipped("optimizer"), clipped("forward", "backward")
    path = {"compute_s": minus(model, waits + updates), "wait_s": float(hidden_time.length(waits)),
            "optimizer_s": minus(updates, waits)}
    path["other_s"] = max(wall - hidden_time.length(waits + updates + model), 0.0)
    out = {"wall_s": wall, "compute_s": sec["forward"] + sec["backward"], "wait_s": path["wait_s"],
           "optimizer_s": sec["optimizer"],
           "optimizer_on_compute_s": sum((s["seconds"] for s in on_compute if s["kind"] == "optimizer"), 0.0),
           "read_s": sec["read"], "write_s": sec["write"],
           "reads": sum(s["kind"] == "read" for s in tl["spans"]),
           "writes": sum(s["kind"] == "write" for s in tl["spans"])}
    if step_s is not None:
        out = {"step_s": step_s, **out}
    if sim is not None and "host_device" in sim:
        copies = sim["host_device"]
        out.update(copies=copies["copies"], copies_busy_s=copies["busy_s"], copies_exposed_s=copies["exposed_s"])
    out["critical_path"] = path
    out["waits"] = _waits_by_place(on_compute)
    return _rounded(out)


def _waits_by_place(on_compute: list[dict]) -> dict:
    """The compute thread's wait spans summed by where each started (TIMELINE_PER_STEP_DOC["waits"])."""
    phases = [(s["kind"], s["start_s"], s["start_s"] + s["seconds"]) for s in on_compute
              if s["kind"] in ("forward", "backward")]
    out = {"forward_reads_s": 0.0, "backward_reads_s": 0.0, "backlog_s": 0.0, "after_backward_s": 0.0}
    for w in (s for s in on_compute if s["kind"] == "wait"):
        phase = next((kind for kind, a, b in phases if a <= w["start_s"] < b), None)
        if w["name"] == "optimizer backlog":
            key = "backlog_s"
        elif phase is None or w["name"].startswith("optimizer"):
            key = "after_backward_s"
        else:
            key = f"{phase}_reads_s"
        out[key] += w["seconds"]
    return out


def median_path(steps: list[dict]) -> dict | None:
    """The timed steps' median wall time and median of each critical-path part (each a
    median of its own, so the parts need not add up to the wall time exactly)."""
    if not steps:
        return None
    out = {"wall_s": statistics.median(s["wall_s"] for s in steps)}
    for key in steps[0]["critical_path"]:
        out[key] = statistics.median(s["critical_path"][key] for s in steps)
    if all("waits" in s for s in steps):
        out["waits"] = {key: statistics.median(s["waits"][key] for s in steps) for key in steps[0]["waits"]}
    return _rounded(out)


def _rounded(d: dict) -> dict:
    """Microseconds: a quick step on a CPU lasts milliseconds."""
    return {k: _rounded(v) if isinstance(v, dict) else round(v, 6) if isinstance(v, float) else v
            for k, v in d.items()}
