"""bench/report.py, which .ci/bench runs on flce_benchmarks' JSON: made-up
rows in the binary's format (no build needed)."""

import json
import os
import subprocess
import sys

REPORT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "report.py")


def flce_row(name, ratio=1.05):
    return {"name": name, "run_type": "iteration", "real_time": 100.0, "time_unit": "ms",
            "median_seconds": 0.1, "items_per_second": 40960.0, "FLOPS": 1e12,
            "ratio_to_gemm": ratio, "peak_extra_bytes": 2**20}


def error_row(name, message):
    return {"name": name, "run_type": "iteration", "error_occurred": True,
            "error_message": message}


def report(tmp_path, text):
    path = tmp_path / "bench.json"
    path.write_text(text)
    return subprocess.run([sys.executable, REPORT, str(path)], capture_output=True, text=True)


def test_a_gemm_row_without_a_native_gemm_is_a_skip_not_a_failure(tmp_path):
    # .ci/bench exited 1 on every CPU whose oneDNN has no bf16 GEMM.
    rows = [flce_row("flce/S1/bf16/fwd/threads:1/iterations:3/manual_time"),
            error_row("gemm/S1/bf16/threads:1/iterations:3/manual_time",
                      "gemm engine openblas has no native bf16 GEMM")]
    r = report(tmp_path, json.dumps({"context": {}, "benchmarks": rows}))
    assert r.returncode == 0, r.stderr
    assert "Skipped:\n- gemm/S1/bf16/threads:1/iterations:3/manual_time: gemm engine openblas" in r.stdout
    assert "Failed" not in r.stdout


def test_a_failed_benchmark_still_fails_the_report(tmp_path):
    rows = [flce_row("flce/S1/f32/fwd/threads:1/iterations:3/manual_time"),
            error_row("flce/S2/f32/fwd/threads:1/iterations:3/manual_time", "out of memory")]
    r = report(tmp_path, json.dumps({"context": {}, "benchmarks": rows}))
    assert r.returncode == 1
    assert "Failed, so not in the table:\n- flce/S2/f32/fwd" in r.stdout


def test_an_empty_file_is_named_not_a_traceback(tmp_path):
    # What flce_benchmarks writes when the filter matches nothing.
    r = report(tmp_path, "")
    assert r.returncode == 1
    assert "is not flce_benchmarks' JSON (it is empty: did the filter match no benchmark?)" in r.stderr
    assert "Traceback" not in r.stderr
