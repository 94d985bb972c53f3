"""The test helpers' CUDA branch, checked on any machine: `same_run` and `assert_matches_in_process` compare within a
tolerance where the device is CUDA (atomic adds), and must still compare label columns and tell different runs apart."""
import pandas as pd
import pytest
import torch

import _device
import _flower_grid


@pytest.fixture
def as_if_cuda(monkeypatch):
    "The helpers believe fglit's device is CUDA (nothing runs on it: they only read `DEV.type`)."
    monkeypatch.setattr(_device, "DEV", torch.device("cuda"))
    monkeypatch.setattr(_flower_grid, "DEV", torch.device("cuda"))


def history(acc0=0.80, split="val", n0=100):
    "A run's history as fglit reports it: numbers beside a text column (the split)."
    return pd.DataFrame({"round": [1, 1], "client": [0, 1], "split": [split, "test"], "n": [n0, 120],
                         "accuracy": [acc0, 0.75], "f1_macro": [0.70, float("nan")]})


def test_same_run_on_cuda_compares_numbers_within_tolerance_and_labels_exactly(as_if_cuda):
    assert _device.same_run(history(), history(0.80 + 0.01))
    assert not _device.same_run(history(), history(0.80 + 0.2))
    assert not _device.same_run(history(), history(split="train"))
    assert not _device.same_run(history(), history().iloc[:1])


def test_on_cuda_a_small_clients_score_may_move_by_three_predictions(as_if_cuda):
    "A client with 5 test nodes moves by 0.2 per flipped prediction: up to three (0.6) pass, four do not; 100 nodes keep 0.05."
    assert _device.same_run(history(0.8, n0=5), history(0.8 - 0.6, n0=5))
    assert not _device.same_run(history(0.8, n0=5), history(0.0, n0=5))
    assert not _device.same_run(history(0.8), history(0.8 - 0.1))
    assert not _device.same_run(history(), history().assign(f1_macro=[0.70, 0.5]))    # a score where the other run has none


def test_flower_comparison_on_cuda_allows_float_order_but_not_other_bytes(as_if_cuda):
    class Fake:
        def __init__(self, h, up=100):
            self.runs = [type("R", (), {"history": h})]
            self._up = up
        def summary(self):
            return {"bytes_up": self._up, "bytes_down": 7}
    _flower_grid.assert_matches_in_process(Fake(history()), Fake(history(0.81)))
    with pytest.raises(AssertionError):
        _flower_grid.assert_matches_in_process(Fake(history()), Fake(history(0.81), up=101))
    with pytest.raises(AssertionError):
        _flower_grid.assert_matches_in_process(Fake(history()), Fake(history(0.95)))
    _flower_grid.assert_matches_in_process(Fake(history(n0=5)), Fake(history(0.4, n0=5)))     # two of five predictions
    with pytest.raises(AssertionError):
        _flower_grid.assert_matches_in_process(Fake(history(n0=5)), Fake(history(0.0, n0=5)))


def comm(bytes_up=94091, floats_up=23475):
    "A run's communication table as `RunResult.communication()` gives it."
    return pd.DataFrame({"round": [1, 1], "client": [0, 0], "direction": ["down", "up"], "bytes": [93420, bytes_up],
                         "floats": [23335, floats_up], "seed": [0, 0]})


def test_same_bytes_on_cuda_allows_a_header_float_written_a_digit_shorter(as_if_cuda):
    assert _device.same_bytes(comm(), comm(94090))               # FedGTA's two CUDA runs in make test-gpu differed so
    assert not _device.same_bytes(comm(), comm(95091))           # a thousand bytes is another message
    assert not _device.same_bytes(comm(), comm(floats_up=23476))  # float counts must agree exactly
    assert not _device.same_bytes(comm(), comm().iloc[:1])
    assert _device.same_total_bytes(1_000_000, 1_000_001) and not _device.same_total_bytes(1_000_000, 1_010_000)


def test_same_bytes_on_the_cpu_is_exact():
    if _device.DEV.type != "cpu":
        pytest.skip("the CPU branch")
    assert _device.same_bytes(comm(), comm()) and not _device.same_bytes(comm(), comm(94090))
    assert not _device.same_total_bytes(10, 11)


def test_deterministic_on_cuda_turns_the_flag_on_inside_and_restores_it(as_if_cuda, monkeypatch):
    "deterministic_on_cuda (the privacy-on-Flower comparison's guard): torch's deterministic kernels, warn-only, and cuBLAS's fixed workspace inside the block; the flags and the environment as they were after it, an exception too."
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    with _device.deterministic_on_cuda():
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert _device.os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) == before
    assert "CUBLAS_WORKSPACE_CONFIG" not in _device.os.environ
    with pytest.raises(RuntimeError, match="inside"), _device.deterministic_on_cuda():
        raise RuntimeError("inside")
    assert torch.are_deterministic_algorithms_enabled() == before[0]


def test_deterministic_on_cuda_leaves_the_cpu_alone(monkeypatch):
    monkeypatch.setattr(_device, "DEV", torch.device("cpu"))
    before = torch.are_deterministic_algorithms_enabled()
    with _device.deterministic_on_cuda():
        assert torch.are_deterministic_algorithms_enabled() == before
