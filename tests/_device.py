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
