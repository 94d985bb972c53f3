"""Run functions for `run_grid` tests that must be importable by spawned worker processes."""
import time
from dataclasses import asdict


def quick_run(exp, seed, quick=False):
    "A finished run at once, with a long field so that a row takes many bytes to write."
    return dict(**asdict(exp), seed=seed, accuracy=0.5 + 0.01 * seed, blob="x" * 4000)


def slow_run(exp, seed, quick=False):
    time.sleep(120)
    return dict(**asdict(exp), seed=seed, accuracy=0.5)
