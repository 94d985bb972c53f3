"""Test helpers for runs on fglit's device (the CPU here, CUDA under `make test-gpu`)."""
import numpy as np
import pandas as pd

from fglit.core import get_device

DEV = get_device()


def same_run(a: pd.DataFrame, b: pd.DataFrame, atol: float = 0.05) -> bool:
    "Two runs of one seed agree: bit for bit on the CPU; on CUDA atomic adds sum floats in a varying order, so within `atol`."
    if DEV.type == "cpu":
        return a.equals(b)
    if a.shape != b.shape or list(a.columns) != list(b.columns):
        return False
    num = [c for c in a.columns if pd.api.types.is_numeric_dtype(a[c]) and pd.api.types.is_numeric_dtype(b[c])]
    rest = [c for c in a.columns if c not in num]          # labels such as the split's name: exactly equal
    return a[rest].reset_index(drop=True).equals(b[rest].reset_index(drop=True)) and \
        np.allclose(a[num].to_numpy(float), b[num].to_numpy(float), atol=atol, equal_nan=True)


def same_bytes(a: pd.DataFrame, b: pd.DataFrame, rtol: float = 0.001) -> bool:
    """Two runs' communication tables (round, client, direction, bytes, floats) agree: exactly on the CPU; on CUDA the
    same messages and float counts, with each message's bytes within `rtol`: a float sent as a number in a message's
    header is written in as many characters as its shortest repr needs, and CUDA's varying sums change its last digits."""
    if DEV.type == "cpu":
        return a.equals(b)
    a, b = a.reset_index(drop=True), b.reset_index(drop=True)
    rest = [c for c in a.columns if c != "bytes"]
    return list(a.columns) == list(b.columns) and a[rest].equals(b[rest]) and \
        bool(((a.bytes - b.bytes).abs() <= rtol * a.bytes.clip(lower=1)).all())


def same_total_bytes(a: int, b: int, rtol: float = 0.001) -> bool:
    "Two runs' byte totals agree: exactly on the CPU, within `rtol` on CUDA (see `same_bytes`)."
    return a == b if DEV.type == "cpu" else abs(a - b) <= rtol * max(a, 1)
