"""SaveOptions: every save option is checked once, where it is given, whoever saves."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import ckptfmt
from ckptfmt.saving.options import LATEST, SaveOptions


def test_a_misspelt_manager_option_fails_when_the_manager_is_made(tmp_path):
    with pytest.raises(TypeError, match=r"^CheckpointManager\(\) got an unexpected keyword argument 'compresion'$"):
        ckptfmt.CheckpointManager(tmp_path / "repo", compresion="zstd")
    assert not (tmp_path / "repo").exists()


def test_a_bad_manager_option_value_fails_when_the_manager_is_made(tmp_path):
    with pytest.raises(ValueError, match="^unknown compression 'lz4'"):
        ckptfmt.CheckpointManager(tmp_path / "repo", compression="lz4")
    with pytest.raises(ValueError, match="^chunk_size must be between"):
        ckptfmt.CheckpointManager(tmp_path / "repo", chunk_size=10)


def test_the_manager_refuses_options_it_sets_for_each_save(tmp_path):
    with pytest.raises(TypeError, match="CheckpointManager sets 'step' itself for each save"):
        ckptfmt.CheckpointManager(tmp_path / "repo", step=3)


def test_the_manager_saves_with_its_options(tmp_path):
    with ckptfmt.CheckpointManager(tmp_path / "repo", compression="zstd", chunk_size=4096) as manager:
        manager.save(5, {"w": torch.zeros(100_000)})  # 400 KB: split, not packed with small tensors
    with ckptfmt.open(tmp_path / "repo" / "step-000000005") as reader:
        chunks = reader.manifest.chunks
    assert {chunk.codec for chunk in chunks} == {"zstd"}
    assert max(chunk.size for chunk in chunks) <= 4096


def test_a_misspelt_async_save_option_fails_before_staging(tmp_path):
    with pytest.raises(TypeError, match=r"^async_save\(\) got an unexpected keyword argument 'stepp'$"):
        ckptfmt.async_save({"w": torch.ones(2)}, tmp_path / "repo" / "a", stepp=1)
    assert not (tmp_path / "repo").exists()


def test_save_takes_exactly_the_options_and_a_timer():
    """The public signature and SaveOptions cannot drift apart: same names, same defaults."""
    parameters = inspect.signature(ckptfmt.save).parameters
    keywords = {name: p.default for name, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    fields = {field.name: field.default for field in dataclasses.fields(SaveOptions)}
    assert keywords == {**fields, "timer": None}
    assert fields["parent"] is LATEST


def test_options_are_frozen_and_checked_again_when_replaced():
    options = SaveOptions(step=3, compression="zstd")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.step = 4
    assert options.replace(step=4).step == 4 and options.step == 3
    with pytest.raises(TypeError, match="^step must be an integer or None, not str$"):
        options.replace(step="4")
    assert SaveOptions(step=torch.tensor(7)).step == 7 and type(SaveOptions(step=torch.tensor(7)).step) is int


@pytest.mark.parametrize("keywords, error, message", [
    ({"workers": 0}, ValueError, "^workers must be a positive integer or None, not 0$"),
    ({"timeout": 0}, ValueError, "^timeout must be a positive number of seconds$"),
    ({"before_commit": "soon"}, TypeError, "^before_commit must be a callable or None$"),
    ({"coordinated": "yes"}, TypeError, "^coordinated must be True, False or None, not 'yes'$"),
    ({"rng": {"rank": 0}}, TypeError, "^rng must be a list of per-rank dicts$"),
], ids=["workers", "timeout", "before_commit", "coordinated", "rng"])
def test_bad_options_are_refused_with_their_name(keywords, error, message):
    with pytest.raises(error, match=message) as info:
        SaveOptions(**keywords)
    assert type(info.value) is error
