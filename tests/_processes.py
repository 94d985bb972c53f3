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


def sessions_and_descendants(pid: int, sessions: set[int], seen: dict[int, float]) -> None:
    """Note in `seen` (pid: start time) every live process below `pid`, and every process in a session one of them opened
    (adding those sessions to `sessions`): what a command started, even where a child left its tree (setsid, reparenting)."""
    import os, psutil
    own = os.getsid(0)
    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            sid = os.getsid(p.pid)
            if sid != own: sessions.add(sid)
            seen.setdefault(p.pid, p.create_time())
        except (OSError, psutil.Error):
            pass
    for p in psutil.process_iter(["create_time"]):
        try:
            if os.getsid(p.pid) in sessions: seen.setdefault(p.pid, p.info["create_time"])
        except OSError:
            pass


def left_alive(seen: dict[int, float], sessions: set[int], wait: float = 10.0) -> list[str]:
    "Those of `seen`, or of `sessions`, still running (zombies have ended) after up to `wait` s: 'pid name' each."
    import os, psutil
    deadline = time.monotonic() + wait
    while True:
        alive = []
        for p in psutil.process_iter(["create_time", "status", "name"]):
            try:
                ours = seen.get(p.pid) == p.info["create_time"] or os.getsid(p.pid) in sessions
            except OSError:
                continue
            if ours and p.info["status"] != psutil.STATUS_ZOMBIE and p.pid != os.getpid():
                alive.append(f"{p.pid} {p.info['name']}")
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)
