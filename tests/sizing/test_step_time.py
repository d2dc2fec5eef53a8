"""The step-time model (Note [step-time model] in offload/sizing/step_time.py): each term
its closed form, the step the largest term with overlap and the sum without, the bound
named; bad rates refused by name. Checked against measurement by
benchmarks/hybrid_sharding.py (benchmarks/RESULTS.md)."""
import pytest

from offload.sizing.step_time import Rates, Work, compare_layouts, predict

N = 1_000_000_000
RATES = Rates(within_node=100e9, across_nodes=10e9, flops=100e12, adam=1e9, bus=50e9, disk=5e9)


def work(**kw):
    base = dict(params=N, trainable=N, param_bytes=2 * N, tokens=1000, world=8, nodes=2, group=4)
    return Work(**{**base, **kw})


def test_each_term_is_its_closed_form():
    p = predict(work(), RATES)  # hybrid: groups of a node's 4 ranks, 2 groups
    assert p.terms["compute"] == pytest.approx(6 * N * 1000 / 100e12)
    assert p.terms["within node"] == pytest.approx(3 / 4 * (2 * 2 * N + 4 * N) / 100e9)
    # a rank's ring all_reduce of its 4N/4 gradient bytes with 1 replica: 2 (R-1)/R of them, 4 ranks a node
    assert p.terms["across nodes"] == pytest.approx(2 * 1 / 2 * 4 * N / 4 * 4 / 10e9)
    assert p.terms["bus"] == pytest.approx((2 * 2 * N / 4 + 4 * N / 4) / 50e9)
    assert p.terms["host Adam"] == pytest.approx(N / 4 / 1e9)
    assert "disk" not in p.terms
    assert p.bound == "across nodes" and p.step == p.terms["across nodes"]
    assert p.bytes == {"within_node": int(3 / 4 * 8 * N), "across_nodes": int(N)}


def test_flat_over_two_nodes_sends_everything_across():
    p = predict(work(group=8), RATES)
    assert "within node" not in p.terms
    assert p.terms["across nodes"] == pytest.approx(7 / 8 * 8 * N / 10e9)
    assert p.bytes["within_node"] == 0


def test_without_overlap_the_step_is_the_sum():
    rates = Rates(**{**RATES.__dict__, "overlap": False})
    p = predict(work(), rates)
    assert p.step == pytest.approx(sum(p.terms.values())) and p.bound == "across nodes"


def test_nvme_reads_are_the_nodes_ranks_together():
    p = predict(work(params_on_nvme=True, state_on_nvme=True), RATES)
    assert p.terms["disk"] == pytest.approx((2 * 2 * N / 4 + 24 * N / 4) * 4 / 5e9)
    with pytest.raises(ValueError, match="NVMe homes or state need the disk's rate"):
        predict(work(params_on_nvme=True), Rates(**{**RATES.__dict__, "disk": None}))


def test_a_window_sums_its_gradients_across_nodes_once():
    one, eight = predict(work(), RATES), predict(work(accumulation=8), RATES)
    for term in ("compute", "within node", "bus"):
        assert eight.terms[term] == pytest.approx(8 * one.terms[term]), term
    assert eight.terms["across nodes"] == one.terms["across nodes"]  # Note [gradients across groups once a window]
    assert eight.terms["host Adam"] == one.terms["host Adam"]
    flat = predict(work(group=8, accumulation=8), RATES)  # the flat layout's gathers cross every micro-step
    assert flat.terms["across nodes"] == pytest.approx(8 * predict(work(group=8), RATES).terms["across nodes"])
    assert eight.bound == "compute" and flat.bound == "across nodes"
    with pytest.raises(ValueError, match="accumulation 0 is not a number of micro-steps"):
        work(accumulation=0)


def test_a_lora_pays_its_base_only_in_gathers():
    lora = compare_layouts(work(trainable=N // 1000, param_bytes=N // 2), RATES)  # a 4-bit base
    assert lora["hybrid"].terms["across nodes"] < lora["flat"].terms["across nodes"] / 100
    assert lora["flat"].bound == "across nodes"


@pytest.mark.parametrize("field, value", [("flops", 0), ("adam", -1.0), ("within_node", float("nan")),
                                          ("across_nodes", True), ("bus", "fast")])
def test_a_bad_rate_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"step-time rate {field}: "):
        Rates(**{**RATES.__dict__, field: value})


def test_work_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="8 ranks must divide into 3 nodes"):
        work(nodes=3)
