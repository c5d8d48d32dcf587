import shutil

import pytest

from tests.models import write_tiny_causal


@pytest.fixture(scope="session")
def bases(tmp_path_factory) -> dict:
    """A tiny causal base, and its NeuZip copies lossless (7 mantissa bits of bf16) and lossy (3): the forms of a
    base the KV cache's tests run every kind on (built once for them all)."""
    from serve.codecs.neuzip_file import encode_dir

    root = tmp_path_factory.mktemp("bases")
    plain = write_tiny_causal(root / "lm")
    out = {"plain": plain}
    for name, bits in (("nz", 7), ("nz3", 3)):
        shutil.copytree(plain, root / name)
        encode_dir(root / name, bits, keep_weights=True)
        out[name] = root / name
    return out
