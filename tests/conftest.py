import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PYTHONWARNINGS", "ignore")

CUDA_SKIP_REASON = "needs a CUDA device: on a GPU machine `python benchmarks/gpu_check.py` runs every test marked cuda"


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` are skipped where torch sees no CUDA device.

    The marker is the one way a test says it needs a GPU, so that ``pytest -m cuda`` (what
    ``benchmarks/gpu_check.py`` runs) selects exactly those tests. torch is imported only when such a
    test was collected.
    """
    marked = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not marked:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=CUDA_SKIP_REASON)
    for item in marked:
        item.add_marker(skip)
