import pytest
import torch

# Every test here exercises a CUDA path; on a machine without CUDA each shows as skipped,
# with the reason (CI has no GPU; scripts/gpu_smoke.sh runs them where one is lent).
_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (none on this machine)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            item.add_marker(_NO_CUDA)
