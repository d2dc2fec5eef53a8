"""`offload bench train`: rounds in rotation, and the figures it derives from them."""
import json
import statistics

import pytest

from offload_bench import train


def _round(median, peak, load=0.0):
    return {"name": "x", "median_s": median, "tokens_per_s": 512 / median, "peak_rss_bytes": peak,
            "step_times_s": [median], "other_load_share": load, "wall_s": 1.0}


def test_rounds_merge_to_the_median_of_round_medians_and_the_highest_peak():
    merged = train._merge_rounds([_round(2.0, 10), _round(1.0, 30), _round(4.0, 20, load=0.2)])
    assert merged["median_s"] == 2.0
    assert merged["peak_rss_bytes"] == 30
    assert merged["tokens_per_s"] == pytest.approx(512 / 2.0, rel=1e-3)
    assert merged["step_times_s"] == [2.0, 1.0, 4.0]
    assert merged["other_load_share"] == 0.2
    assert [r["median_s"] for r in merged["rounds"]] == [2.0, 1.0, 4.0]


def test_a_failed_round_is_the_contenders_result():
    failed = {"name": "x", "error": "exit status 1"}
    assert train._merge_rounds([_round(1.0, 10), failed]) is failed
    assert train._merge_rounds([_round(1.0, 10)]) == _round(1.0, 10)


@pytest.mark.slow
def test_two_quick_rounds_in_rotation_and_the_same_losses_as_torch(tmp_path, capsys):
    out = tmp_path / "out"
    rc = train.main(["--quick", "--rounds", "2", "--contenders", "torch,offload-cpu", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "train.json").read_text())
    assert report["settings"]["rounds"] == 2
    for name in ("torch", "offload-cpu"):
        r = report["results"][name]
        assert len(r["rounds"]) == 2
        assert r["median_s"] == pytest.approx(statistics.median(x["median_s"] for x in r["rounds"]), abs=1e-4)
        assert r["peak_rss_bytes"] == max(x["peak_rss_bytes"] for x in r["rounds"])
    # Same seeded model and batches: the engine's losses are plain torch's.
    assert report["results"]["offload-cpu"]["losses"] == pytest.approx(report["results"]["torch"]["losses"],
                                                                     abs=1e-4)


def test_rounds_below_one_are_refused_before_anything_is_made(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # where --out (bench_out) and the NVMe directory would go
    assert train.main(["--quick", "--rounds", "0", "--contenders", "torch"]) == 2
    assert "--rounds must be at least 1" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
