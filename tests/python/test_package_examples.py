"""The Python examples run: examples/train_tiny_lm/train.py trains (its loss
falls, it measures both steps' memory and saves the files for `flce eval`)
and examples/gpu_kernel_test passes (ctest also runs that directory whole).
"""

import os
import re
import subprocess
import sys

from test_package_reference import DEFAULT_PYTHONPATH, import_flce, np

import_flce()
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, FLCE_PYTHONPATH=os.environ.get("FLCE_PYTHONPATH", DEFAULT_PYTHONPATH))


def test_train_tiny_lm_loss_falls(tmp_path):
    out = tmp_path / "model"
    cmd = [sys.executable, os.path.join(REPO, "examples", "train_tiny_lm", "train.py"),
           "--steps", "40", "--batch", "1024", "--measure-steps", "1", "--out", str(out)]
    run = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    text = run.stdout
    m = re.search(r"RESULT first_train_loss=(\S+) last_train_loss=(\S+) val_start=(\S+) "
                  r"val_end=(\S+)", text)
    assert m, text
    first, last, val_start, val_end = map(float, m.groups())
    assert last < first - 1.0 and val_end < val_start - 0.5, text
    if "unavailable (" not in text:  # where /proc/self/clear_refs can be written
        peaks = dict(re.findall(r"^\s+(flce|materialized):\s+([\d.]+) MiB", text, re.M))
        assert set(peaks) == {"flce", "materialized"}, text
        assert float(peaks["flce"]) < float(peaks["materialized"]), text
    h, w, y = (np.load(out / f) for f in ("H.npy", "W.npy", "Y.npy"))
    assert h.dtype == w.dtype == np.float32 and y.dtype == np.int64
    assert h.shape == (y.shape[0], w.shape[1]) and y.max() < w.shape[0]
    assert f"eval --x {out}/H.npy --w {out}/W.npy --labels {out}/Y.npy" in text


def test_gpu_kernel_test_example_passes():
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           os.path.join(REPO, "examples", "gpu_kernel_test"), "-k", "normal or catches"]
    run = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"\d+ passed", run.stdout), run.stdout
