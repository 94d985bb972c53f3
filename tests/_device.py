"""Test helpers for runs on fglit's device (the CPU here, CUDA under `make test-gpu`)."""
import contextlib
import os

import numpy as np
import pandas as pd
import pytest

from fglit.core import get_device

DEV = get_device()
SCORES = {"accuracy", "f1_macro", "f1_macro_present", "auc"}   # a history's per-client score columns


def score_tolerance(n, atol: float = 0.05):
    """On CUDA, how far one client's score may move between two runs of one seed: `atol`, or three of its `n` predictions
    flipped where that is more (a client with 5 test nodes moves by 0.2 per prediction; its AUC by 1/(positives x negatives)
    when two near-tied scores swap)."""
    return np.maximum(atol, 3.0 / np.maximum(np.asarray(n, float), 1.0))


def same_run(a: pd.DataFrame, b: pd.DataFrame, atol: float = 0.05) -> bool:
    """Two runs of one seed agree: bit for bit on the CPU; on CUDA atomic adds sum floats in a varying order, so within
    `atol` (a per-client table's scores within `score_tolerance` of their row's `n`)."""
    if DEV.type == "cpu":
        return a.equals(b)
    if a.shape != b.shape or list(a.columns) != list(b.columns):
        return False
    num = [c for c in a.columns if pd.api.types.is_numeric_dtype(a[c]) and pd.api.types.is_numeric_dtype(b[c])]
    rest = [c for c in a.columns if c not in num]          # labels such as the split's name: exactly equal
    tol = np.full((len(a), len(num)), atol)
    if "n" in a.columns:                                   # per-client rows: each score column within its row's tolerance
        scores = [i for i, c in enumerate(num) if c in SCORES]
        tol[:, scores] = score_tolerance(a["n"].to_numpy(), atol)[:, None]
    diff = np.abs(a[num].to_numpy(float) - b[num].to_numpy(float))
    return a[rest].reset_index(drop=True).equals(b[rest].reset_index(drop=True)) and \
        bool(np.all((diff <= tol) | (np.isnan(diff) & a[num].isna().to_numpy() & b[num].isna().to_numpy())))


@contextlib.contextmanager
def deterministic_on_cuda():
    """On CUDA, torch's deterministic kernels inside the block (`index_add_`, `scatter_add_` and cuBLAS sum in a fixed order;
    an op without such a kernel warns instead of failing), so that two runs of one seed sum their floats alike. Nothing
    changes on the CPU, whose kernels already are deterministic."""
    import torch
    if DEV.type != "cuda":
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")    # cuBLAS's fixed-order reductions (read where a handle is made)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        if workspace is None: os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def same_tensor(a, b, atol: float = 1e-4) -> bool:
    "Two tensors from two runs of one seed: equal on the CPU, within `atol` on CUDA (atomic adds in a varying order)."
    import torch
    return torch.equal(a, b) if DEV.type == "cpu" else torch.allclose(a, b, atol=atol)


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


# fglit's C routines (surrogate graph, stages, local steps) run on the CPU only: on CUDA a run that asks for one warns
# and trains on torch, which the device-reason tests check; the tests that compare a routine with the torch path skip there
cpu_routine = pytest.mark.skipif(DEV.type != "cpu", reason="fglit's C routines run on the CPU; fglit computes on " + DEV.type + " here")
