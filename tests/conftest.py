import os

import pytest
import torch

# Without CUDA, Triton kernels run under its CPU interpreter; this must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and (not HAS_CUDA or torch.cuda.device_count() < 2):
            item.add_marker(skip_multi)


@pytest.fixture
def device():
    return "cuda" if HAS_CUDA else "cpu"


# the LSE toolkit's kernels and the launches they make (tests/test_lse_*.py)
@pytest.fixture
def kernels():
    from ringlse.lse.kernels import softmax as ks

    return ks


@pytest.fixture
def launches():
    """The launches the softmax launchers make during the test (`launch.recorded_launches`)."""
    from ringlse.kernels.launch import recorded_launches

    with recorded_launches() as seen:
        yield seen
