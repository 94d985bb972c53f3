"""Process checks shared by the benchmark tests."""
import time
from pathlib import Path


def assert_process_ends(pid: int, what: str, tries: int = 50) -> None:
    "Wait up to `tries` x 0.1 s for process `pid` to be gone (or a zombie until init reaps it); fail naming it as `what` and its state otherwise."
    state = "unknown"
    for _ in range(tries):
        try:
            state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State:"))
        except FileNotFoundError:
            return
        if "Z" in state.split()[1]:
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} {pid} is still running ({state})")
