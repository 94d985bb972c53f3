"""What the benchmark scripts share: the commit they ran at, the device in words, and a dataset given by name or as a synthetic graph spec."""
from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def short_commit() -> str:
    "The repository's HEAD as a short sha ('' outside a git checkout)."
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def device_name() -> str:
    "The device fglit computes on, in words: `cuda:<GPU name>`, or `cpu:<processor> (<n> thread(s))`."
    import platform
    import torch
    from fglit.core import get_device
    device = get_device()
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{platform.processor() or platform.machine()} ({torch.get_num_threads()} thread(s))"


def bench_dataset(spec: str):
    "A dataset by name, or `synthetic:NODES:EDGES:CLASSES:FEATURES`: fglit.synthetic's graph (homophily 0.8, feature signal 0.5, seed 0)."
    if spec.startswith("synthetic:"):
        from fglit.own_data import as_dataset
        from fglit.synthetic import synthetic_graph
        n, m, c, f = (int(v) for v in spec.split(":")[1:])
        return as_dataset(synthetic_graph(n, m, c, f, homophily=0.8, feature_signal=0.5, seed=0), name=f"synthetic-{n}")
    from fglit.data import load_dataset
    return load_dataset(spec)
