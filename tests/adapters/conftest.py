import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from threads; on a shared 2-core machine two spinning threads run 4x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
