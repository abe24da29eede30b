"""comm/cuda: the answer to "does MPI take device buffers?", and its override."""

import pytest

from lightning_mpi.comm.cuda import ENV_OVERRIDE, mpi_is_cuda_aware


@pytest.fixture(autouse=True)
def fresh_answer():
    mpi_is_cuda_aware.cache_clear()
    yield
    mpi_is_cuda_aware.cache_clear()


@pytest.mark.parametrize("value, expected", [("1", True), ("yes", True), (" ON ", True), ("0", False), ("no", False)])
def test_the_environment_overrides_the_answer(monkeypatch, value, expected):
    monkeypatch.setenv(ENV_OVERRIDE, value)
    assert mpi_is_cuda_aware() is expected


def test_the_loaded_library_answers_without_an_override(monkeypatch):
    monkeypatch.delenv(ENV_OVERRIDE, raising=False)
    assert isinstance(mpi_is_cuda_aware(), bool)
