"""benchmarks/suite.py (issue #28's one command): what it would run, what it records when a benchmark cannot run or
runs out of time, and a real run of quick benchmarks on their tiny size. (Each benchmark's own tiny run is tested beside
its script: test_stacked, test_synthetic, test_flower_overhead.)"""
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SUITE = REPO / "benchmarks" / "suite.py"
sys.path.insert(0, str(REPO / "benchmarks"))
import suite  # noqa: E402
from _processes import assert_process_ends  # noqa: E402


def _suite(*args, timeout=900):
    return subprocess.run([sys.executable, str(SUITE), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_list_names_every_benchmark_with_an_existing_script_and_its_output(tmp_path):
    proc = _suite("--list", "--size", "tiny", "--out-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for b in suite.BENCHMARKS:
        mine = [line for line in lines if line.startswith(f"[{b.name} on cpu]")]
        assert len(mine) == len(b.tiny), b.name
        assert (REPO / "benchmarks" / b.script).exists() and str(tmp_path) in mine[0]
    assert not any(line.startswith("[startup on cuda]") for line in lines)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the record of a machine without CUDA")
def test_cuda_runs_are_skipped_with_a_reason_without_cuda(tmp_path):
    proc = _suite("--list", "--devices", "cuda", "cpu", "--only", "client_scaling", "startup", "--out-dir", str(tmp_path))
    lines = proc.stdout.splitlines()
    assert [line.split("]")[0] for line in lines] == ["[client_scaling on cuda"] * 2 + ["[client_scaling on cpu"] * 2 + ["[startup on cpu"]
    assert all("SKIPPED: no CUDA device" in line for line in lines if "on cuda]" in line)
    assert not any("SKIPPED" in line for line in lines if "on cpu]" in line)


def test_gpu_tags():
    assert [suite.gpu_tag(n) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "Tesla T4", "NVIDIA H200")] == \
        ["h100", "a100", "t4", "h200"]


def test_overrides_replace_a_benchmarks_arguments_and_unknown_names_are_refused():
    over = suite.parse_overrides(["synthetic_scale=--sizes 10:20 --clients 2", "synthetic_scale=--sizes 30:40"])
    assert over == {"synthetic_scale": [["--sizes", "10:20", "--clients", "2"], ["--sizes", "30:40"]]}
    bench = next(b for b in suite.BENCHMARKS if b.name == "synthetic_scale")
    cmds = suite.commands(bench, "full", Path("/o.csv"), Path("/w"), "cpu", Path("/py"), over)
    assert [c[2:] for c in cmds] == [["--sizes", "10:20", "--clients", "2", "--out", "/o.csv"], ["--sizes", "30:40", "--out", "/o.csv"]]
    with pytest.raises(SystemExit, match="NAME one of"):
        suite.parse_overrides(["nope=--x 1"])


def test_a_run_records_what_ran_what_was_skipped_and_what_ran_out_of_time(tmp_path):
    out = tmp_path / "bench"
    proc = _suite("--size", "tiny", "--out-dir", str(out), "--work", str(tmp_path / "work"), "--tag", "t",
                  "--only", "fedavg_vs_openfgl", "stacked_vs_vmap", "startup", "--openfgl-python", str(tmp_path / "no-python"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = pd.read_csv(out / "suite.csv").set_index("benchmark")
    assert rows.loc["fedavg_vs_openfgl", "status"] == "skipped" and "no-python" in rows.loc["fedavg_vs_openfgl", "reason"]
    assert (rows.loc[["stacked_vs_vmap", "startup"], "status"] == "ok").all()
    assert (rows.loc[["stacked_vs_vmap", "startup"], "wall_s"] > 0).all()
    vmap = pd.read_csv(out / "stacked_vs_vmap_t.csv")                    # the tag names the output file
    assert sorted(vmap.method) == ["block-diagonal", "vmap"] and (vmap.step_s > 0).all() and vmap.device.str.startswith("cpu").all()
    assert len(pd.read_csv(out / "startup_t.csv")) == 3
    assert (out / "suite_logs" / "stacked_vs_vmap_cpu.log").read_text().startswith("$ ")

    proc = _suite("--size", "tiny", "--out-dir", str(out), "--only", "client_scaling", "--budget", "2")
    rows = pd.read_csv(out / "suite.csv")
    last = rows.iloc[-1]
    assert proc.returncode == 0 and last.benchmark == "client_scaling" and last.status == "stopped" and "budget" in last.reason
    assert len(rows) == 4                                                 # appended to the same summary


def test_a_failing_benchmark_fails_the_suite(tmp_path):
    proc = _suite("--out-dir", str(tmp_path), "--only", "startup", "--args", "startup=--no-such-option")
    assert proc.returncode == 1
    row = pd.read_csv(tmp_path / "suite.csv").iloc[0]
    assert row.status == "failed" and row["size"] == "args" and "exit status 2" in row.reason


def test_short_size_runs_the_largest_graph_on_the_first_device_only(tmp_path):
    proc = _suite("--list", "--size", "short", "--devices", "cpu", "cuda", "--only", "synthetic_scale", "opfgl_engines", "--out-dir", str(tmp_path))
    lines = proc.stdout.splitlines()
    assert "SKIPPED: --size short runs it on cpu only" in next(line for line in lines if line.startswith("[synthetic_scale on cuda]"))
    cpu = [line for line in lines if line.startswith("[synthetic_scale on cpu]")]
    assert len(cpu) == 1 and "SKIPPED" not in cpu[0] and "--sizes 2449029:61859140" in cpu[0] and "--partitions metis --stages" in cpu[0]
    assert sum(line.startswith("[opfgl_engines on cpu]") for line in lines) == 2


def test_a_stopped_benchmark_takes_its_child_processes_with_it(tmp_path):
    "Past its time a benchmark's whole process group goes (stage processes, Ray), not only the script itself."
    import os
    pid_file = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    with open(tmp_path / "log.txt", "w") as log, pytest.raises(subprocess.TimeoutExpired):
        suite.run_in_group([sys.executable, "-c", code], 5, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    assert_process_ends(int(pid_file.read_text()), "the benchmark's child")


@pytest.mark.skipif(not (REPO / ".venv" / "bin" / ".installed").exists(), reason="runs .ci/gpu_session.sh over the checkout's .venv (make setup)")
def test_gpu_session_passes_suite_args_as_a_shell_would_and_runs_the_tests_it_is_given(tmp_path):
    """.ci/gpu_session.sh, tried with DEV=cpu in a copy of the checkout's layout (links): SUITE_ARGS reaches the suite split
    as a shell would split it (an --args 'NAME=ARGS' override keeps its ARGS together), and MODE=split runs the test ids
    listed in TESTS, with pytest's per-test limit only where pytest-timeout is installed."""
    import os
    import tarfile
    work, out = tmp_path / "checkout", tmp_path / "out"
    work.mkdir()
    for name in (".ci", ".venv", "benchmarks", "fglit", "tests", "nbs", "settings.ini"):
        (work / name).symlink_to(REPO / name)
    (work / ".gpu" / "data" / "Cora").mkdir(parents=True)                     # the datasets "unpacked": no tar to open
    (tmp_path / "owed.txt").write_text("# one quick test\ntests/test_bench_suite.py::test_gpu_tags\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTHONPATH")} | dict(
        DEV="cpu", OUT=str(out), MODE="split", NOTEBOOKS="no-such-notebook", TESTS=str(tmp_path / "owed.txt"), PYTEST_JOBS="1",
        BENCH="suite", SUITE_ARGS="--list --only opfgl_engines --args 'opfgl_engines=--seeds 0 --engines stacked'")
    proc = subprocess.run(["bash", ".ci/gpu_session.sh"], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in (out / "pytest.log").read_text()
    with tarfile.open(out / "bench.tgz") as tar:
        listed = tar.extractfile("bench/log_suite.txt").read().decode()
    assert "opfgl_engines.py --seeds 0 --engines stacked --out" in listed, listed
