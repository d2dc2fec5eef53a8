"""`offload bench compile` (benchmarks/offload_bench/compile_blocks.py): the example
GPT with its blocks compiled through engine.compile() breaks no graph and trains
equal to plain torch compiled the same way, with and without checkpointing."""
import argparse
import json

import pytest

from offload_bench import compile_blocks

pytestmark = pytest.mark.torch_release  # Note [torch releases in CI] (tests/conftest.py)


def test_the_quick_run_reports_no_break_and_equal_losses(tmp_path):
    parser = argparse.ArgumentParser()
    compile_blocks.add_arguments(parser)
    assert compile_blocks.run(parser.parse_args(["--quick", "--steps", "2", "--out", str(tmp_path)])) == 0
    result = json.loads((tmp_path / "compile_blocks.json").read_text())
    assert [c["checkpointing"] for c in result["cases"]] == [False, True]
    for case in result["cases"]:
        assert case["graph_breaks"] == {"torch": 0, "ours": 0}, case
        assert case["unique_graphs"] == {"torch": 1, "ours": 1}, case
        assert case["losses"]["ours_compiled"] == case["losses"]["torch_compiled"], case
    assert result["all_breaks_ours"] == 0


def test_unknown_choices_are_refused(tmp_path):
    parser = argparse.ArgumentParser()
    compile_blocks.add_arguments(parser)
    assert compile_blocks.run(parser.parse_args(["--models", "gpt,bert", "--out", str(tmp_path)])) == 2
    assert not (tmp_path / "compile_blocks.json").exists()
