"""Device choice and seeding live in fglit.core; these tests pin their behaviour."""
import subprocess
import sys

import pytest
import torch

from fglit import core


def _device_in_subprocess(env_value):
    code = "from fglit.core import get_device; print(get_device())"
    env = {"FGLIT_DEVICE": env_value} if env_value is not None else {}
    import os
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env})


def test_device_override_and_default():
    assert _device_in_subprocess("cpu").stdout.strip() == "cpu"
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    out = _device_in_subprocess("")
    assert out.stdout.strip() == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_requested_without_cuda_is_clear_error():
    out = _device_in_subprocess("cuda")
    assert out.returncode != 0 and "no CUDA device" in out.stderr


def test_seed_everything_repeats_and_differs():
    core.seed_everything(3); a = torch.randn(5)
    core.seed_everything(3); b = torch.randn(5)
    core.seed_everything(4); c = torch.randn(5)
    assert torch.equal(a, b) and not torch.equal(a, c)
    with pytest.raises(ValueError, match="seed"):
        core.seed_everything(-1)


def test_data_root_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("FGLIT_DATA", str(tmp_path / "env"))
    assert core.data_root(tmp_path / "arg") == tmp_path / "arg"
    assert core.data_root() == tmp_path / "env"
    monkeypatch.delenv("FGLIT_DATA")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert core.data_root() == tmp_path / "xdg" / "fglit" / "datasets"


def test_permission_bits_make_a_folder_read_only(tmp_path):
    assert core.is_writable(tmp_path)
    tmp_path.chmod(0o555)
    try:
        assert not core.is_writable(tmp_path) and not core.is_writable(tmp_path / "child")
    finally:
        tmp_path.chmod(0o755)


@pytest.mark.gpu
def test_everything_lands_on_cuda():
    from fglit.data import load_dataset
    from fglit.models import build_model, train_node_classifier
    assert core.get_device().type == "cuda"
    ds = load_dataset("Cora")
    model = build_model("gcn", ds.num_features, ds.num_classes)
    result = train_node_classifier(model, ds.data, epochs=50)
    assert next(model.parameters()).is_cuda and ds.data.x.is_cuda and result["test_acc"] > 0.7


from hypothesis import given, settings, strategies as st
import numpy as np


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-2**62, 2**62), max_size=200), st.booleans())
def test_sorted_unique_matches_numpy(values, copy):
    a = np.asarray(values, dtype=np.int64)
    kept = a.copy()
    got = core.sorted_unique(a, copy=copy)
    assert got.dtype == np.int64 and np.array_equal(got, np.unique(kept))
    assert np.array_equal(a, kept if copy else np.sort(kept))      # copy=False sorts the input in place, copy=True keeps it


def test_sorted_unique_rejects_2d():
    with pytest.raises(ValueError, match="1-D"):
        core.sorted_unique(np.zeros((2, 2)))
