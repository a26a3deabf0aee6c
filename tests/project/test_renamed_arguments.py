"""Peer functions take their arguments the same way; the spellings they had before still work, warning."""

from __future__ import annotations

import warnings

import pytest
import torch
from fsspec.callbacks import Callback

import ckptfmt
from ckptfmt._deprecation import renamed_arguments
from ckptfmt.analytics import health, stragglers
from ckptfmt.lifecycle.advise import advise
from ckptfmt.tools.diff import diff


@pytest.fixture
def run(tmp_path) -> str:
    """A repository of three checkpoints saved by a timed loop (advise needs timing and two saves)."""
    url = str(tmp_path / "run")
    timer = ckptfmt.StepTimer()
    for step in (1, 2, 3):
        with timer.step(step):
            pass
        ckptfmt.save({"w": torch.full((8,), float(step))}, f"{url}/s{step}", step=step, timer=timer)
    return url


def deprecated(call):
    """``call()``'s result, checking that it warned of one old argument name and nothing else."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(messages) >= 1 and all("is deprecated: use" in m for m in messages), messages
    assert all(w.filename == __file__ for w in caught)  # the warning points at the caller's line
    return result


def test_old_argument_names_give_the_same_results_with_a_warning(run, tmp_path):
    a, b = f"{run}/s1", f"{run}/s3"
    assert deprecated(lambda: diff(url_a=a, url_b=b)) == diff(a, b)
    assert deprecated(lambda: health(run=run)) == health(run)
    assert deprecated(lambda: stragglers(source=run)) == stragglers(run)
    assert deprecated(lambda: advise(repo_url=run, mtbf_s=3600.0)) == advise(run, mtbf=3600.0)

    counted = Callback()
    report = deprecated(lambda: ckptfmt.replicate(run, str(tmp_path / "copy"), progress=counted))
    assert report.copied == ("s1", "s2", "s3") and counted.value > 0


def test_an_old_and_a_new_name_together_are_refused(run):
    with pytest.raises(TypeError, match="both url_a= and a="):
        diff(f"{run}/s1", f"{run}/s2", url_a=f"{run}/s1")  # url_a and the positional a


def test_the_decorator_renames_only_the_named_keywords():
    @renamed_arguments(old="new")
    def f(new=None, other=None):
        return new, other

    with pytest.warns(DeprecationWarning, match=r"f\(old=...\) is deprecated: use new="):
        assert f(old=1, other=2) == (1, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert f(new=1) == (1, None) and f(3) == (3, None)
    assert f.__name__ == "f" and f.__wrapped__ is not None
