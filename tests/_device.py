"""Test helpers for runs on fglit's device (the CPU here, CUDA under `make test-gpu`)."""
import numpy as np
import pandas as pd

from fglit.core import get_device

DEV = get_device()


def same_run(a: pd.DataFrame, b: pd.DataFrame, atol: float = 0.05) -> bool:
    "Two runs of one seed agree: bit for bit on the CPU; on CUDA atomic adds sum floats in a varying order, so within `atol`."
    if DEV.type == "cpu":
        return a.equals(b)
    return a.shape == b.shape and list(a.columns) == list(b.columns) and \
        np.allclose(a.to_numpy(float), b.to_numpy(float), atol=atol, equal_nan=True)
