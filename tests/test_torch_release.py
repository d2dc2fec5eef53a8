"""The supported torch releases: one list (offload/requirements.py TORCH_TESTED),
the range pip is given, the run-time refusal of a torch older than it and the
warning for one newer, exercised by monkeypatching the version string read."""
import re

import pytest
import torch

from offload import requirements
from offload import torch_release
from offload.torch_release import check_torch_release, torch_release_problem

pytestmark = pytest.mark.torch_release  # Note [torch releases in CI] (tests/conftest.py)


def test_the_range_runs_from_the_oldest_to_the_newest_tested_minor():
    assert requirements.TORCH_TESTED == ("2.11.0", "2.13.0", "2.14.1")
    assert requirements.TORCH_SPECIFIER == ">=2.11"
    assert "torch>=2.11" in requirements.install_requires()


def test_the_torch_running_the_suite_is_supported():
    assert torch_release_problem() is None
    check_torch_release()


@pytest.mark.parametrize("version", ["2.11.0", "2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.14.1", "2.14.3",
                                     "2.14.0a0+gitabc123"])
def test_releases_inside_the_range_pass_silently(monkeypatch, recwarn, version):
    monkeypatch.setattr(torch, "__version__", version)
    check_torch_release()
    assert not [w for w in recwarn if "torch" in str(w.message)]


@pytest.mark.parametrize("version", ["2.15.0", "2.15.0.dev20261201+cu130", "3.0.0"])
def test_releases_newer_than_every_tested_one_warn_once_naming_it_and_the_tested_ones(monkeypatch, version):
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(torch_release, "_warned", set())
    with pytest.warns(RuntimeWarning, match=re.escape(f"torch {version} is newer than every release offload is "
                                                      "tested on (2.11.0, 2.13.0, 2.14.1)")):
        check_torch_release()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_torch_release()  # once per process


@pytest.mark.parametrize("version", ["2.10.2", "2.1.0", "1.13.1", "unknown"])
def test_releases_older_than_the_range_are_refused_naming_it_the_range_and_the_fix(monkeypatch, version):
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(RuntimeError) as raised:
        check_torch_release()
    message = str(raised.value)
    assert message == torch_release_problem()
    assert f"this Python has torch {version}." in message
    assert "offload supports torch >=2.11 (tested: 2.11.0, 2.13.0, 2.14.1)" in message
    assert re.search(r"`pip install torch==2\.14\.1` \(or 2\.11\.0 or 2\.13\.0\)", message)
