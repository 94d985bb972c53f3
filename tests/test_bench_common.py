"""benchmarks/_common: a stage in a fresh interpreter (run_stage: its JSON results, and its failure in one line), and O-pFGL's stage times from its logs (opfgl_parts)."""
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._common import run_stage  # noqa: E402
from _processes import assert_process_ends  # noqa: E402

ENV = dict(os.environ)
TWO_ROWS = "import json, sys; a = json.loads(sys.argv[1]); print(json.dumps({'x': a[0]})); print('noise'); print(json.dumps({'x': a[1]}), flush=True)"


def test_results_are_the_printed_json_lines():
    assert run_stage(TWO_ROWS, [1, 2], ENV, 60) == ([{"x": 1}, {"x": 2}], None)


def test_a_failure_is_its_last_stderr_line_and_earlier_results_are_kept():
    rows, error = run_stage(TWO_ROWS + "; raise ValueError('the graph is too big')", [3, 4], ENV, 60)
    assert rows == [{"x": 3}, {"x": 4}] and error == "ValueError: the graph is too big"


def test_a_time_limit_and_a_signal_are_named():
    rows, error = run_stage(TWO_ROWS + "; import time; time.sleep(30)", [5, 6], ENV, 3)
    assert error == "over 3 s" and rows == [{"x": 5}, {"x": 6}]
    assert run_stage("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", [], ENV, 60) == ([], "killed by signal 9")


def test_a_timed_out_stage_takes_its_forked_children_with_it(tmp_path):
    "A stage past its time is killed with its whole process group: a forked child (as O-pFGL's stage workers are) does not outlive it, and its results printed before stay."
    import time
    pid_file = tmp_path / "child.pid"
    code = TWO_ROWS + f"; import os, time\nif os.fork() == 0: open({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)"
    start = time.perf_counter()
    rows, error = run_stage(code, [7, 8], ENV, 3)
    assert error == "over 3 s" and rows == [{"x": 7}, {"x": 8}] and time.perf_counter() - start < 20
    assert_process_ends(int(pid_file.read_text()), "the stage's forked child")


def test_a_stage_row_takes_its_last_result_or_its_error():
    from benchmarks._common import stage_outcome
    assert stage_outcome([{"x": 1}, {"x": 2}], None) == {"x": 2}
    assert stage_outcome([{"x": 1}], "over 3 s") == {"error": "over 3 s"} and stage_outcome([], None) == {}


def test_row_log_writes_the_fields_of_each_row_and_counts_them(tmp_path, capsys):
    import pandas as pd
    from benchmarks._common import RowLog
    log = RowLog(tmp_path / "rows.csv", ["a", "b"])
    log.write({"a": 1, "b": 2, "c": 3}); log.write({"a": 4})
    assert pd.read_csv(tmp_path / "rows.csv").fillna(-1).values.tolist() == [[1, 2], [4, -1]]
    assert log.summary().startswith("appended 2 rows to") and capsys.readouterr().out.count('"a"') == 2


def test_short_commit_marks_a_modified_checkout(tmp_path, monkeypatch):
    "A benchmark row run on uncommitted code says so: HEAD's sha plus '+modified' once fglit/ differs from HEAD."
    import subprocess
    import benchmarks._common as common
    repo = tmp_path / "repo"
    (repo / "fglit").mkdir(parents=True)
    (repo / "fglit" / "a.py").write_text("x = 1\n")
    git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=repo, check=True, capture_output=True)
    git("init", "-q"); git("add", "."); git("commit", "-qm", "one")
    monkeypatch.setattr(common, "REPO", repo)
    clean = common.short_commit()
    assert clean and "+" not in clean
    (repo / "fglit" / "README.md").write_text("notes\n")          # documentation is not what a benchmark measures
    assert common.short_commit() == clean
    (repo / "fglit" / "a.py").write_text("x = 2\n")
    assert common.short_commit() == clean + "+modified"


def test_opfgl_parts_add_a_process_stacks_and_take_the_slowest_process():
    "Stage times from O-pFGL's logs: the sequential engine's clients add up; the stacked engine's clients of one stack share its time, a process's stacks add up, and the processes run at once."
    import types
    from benchmarks._common import opfgl_parts
    server = types.SimpleNamespace(graph=types.SimpleNamespace(seconds=2.0, kernel="c"))
    logs = [dict(stage1_s=1.0, stage2_s=3.0, stage_process=0, stage_stack=0, stage_peak_rss_mb=900.0),
            dict(stage1_s=1.0, stage2_s=3.0, stage_process=0, stage_stack=0, stage_peak_rss_mb=900.0),
            dict(stage1_s=0.5, stage2_s=2.0, stage_process=0, stage_stack=1, stage_peak_rss_mb=900.0),
            dict(stage1_s=1.2, stage2_s=4.0, stage_process=1, stage_stack=0, stage_peak_rss_mb=700.0)]
    assert opfgl_parts(server, logs, "stacked") == dict(surrogate_s=2.0, surrogate_kernel="c", stage1_s=1.5, stage2_s=5.0,
                                                        worker_peak_rss_mb=700.0)      # the forked worker's (process 1), not this one's
    assert opfgl_parts(server, logs, "sequential")["stage2_s"] == 12.0
    assert opfgl_parts(types.SimpleNamespace(graph=None), [dict(stage2_s=1.0)], "stacked") == \
        dict(surrogate_s=0.0, surrogate_kernel="none", stage1_s=0.0, stage2_s=1.0, worker_peak_rss_mb=0.0)
