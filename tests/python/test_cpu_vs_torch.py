"""Cross-checks `flce run --backend cpu` against the independent float64
PyTorch autograd reference of test_run_vs_torch.py (imported, not copied).

Run with Debian's interpreter:  /usr/bin/python3 -m pytest -q tests/python
(add `-s` to see the per-dtype/mode worst relative errors printed at the end).

Acceptance check: the cpu backend agrees with the float64 reference to
    2e-4 (norm-wise relative, `assert_close` of test_run_vs_torch.py) on every
         output and gradient, for f32, bf16 and f16 storage with f32 dlogits
         (`--grad-logits f32`, the default);
    2e-2 on the gradients with `--grad-logits storage` (dlogits rounded to the
         storage dtype before the gradient GEMMs).  The forward outputs (loss,
         lse, logprob, entropy, zloss) do not depend on --grad-logits and are
         still held to 2e-4; with f32 storage the cast is the identity, so
         those cases are held to 2e-4 throughout.
Inputs are float32 .npy files; for --dtype bf16/f16 the expected values are
computed from the rounded inputs (round-to-nearest-even from float32, as in
test_run_vs_torch.py), so the tolerance measures the backend's arithmetic,
not the storage rounding.

argmax: flce's argmax must equal the reference argmax (over the softcapped
logits s, float64) on every row whose top-two gap of the expected s exceeds
ARGMAX_GAP = 1e-3.  On rows with a smaller gap the backend's f32 logits (from a
blocked GEMM with a different summation order, and in bf16/f16 from products
of rounded operands) can legitimately pick the other near-tied class; there
we only require that the chosen class is within ARGMAX_GAP of the maximum.

Shapes cross the cpu backend's tiling (src/cpu/plan.h): vocab tile 512
(V in {1, 7, 511, 512, 513, 1500}), row blocks of up to 256 rows (N in
{255, 256, 257} with small H), hidden chunk 256 for grad_x (H = 300).
A few cases force each GEMM engine with --gemm (openblas, onednn, eigen);
an engine not compiled into the binary is skipped (fails under CI=true,
where .ci/deps installs all three).

Also: `--threads T` for T = 1, 2, 3 must write byte-identical outputs.
"""

import dataclasses
import filecmp
import os
import random
import re
import subprocess
from typing import Optional

import pytest

np = pytest.importorskip(
    "numpy",
    reason="numpy missing: run with /usr/bin/python3 (apt python3-numpy)")
torch = pytest.importorskip(
    "torch",
    reason="torch missing: run with /usr/bin/python3 (apt python3-torch)")

from test_run_vs_torch import (  # noqa: E402
    Case, _expected_shapes, _make_data, _storage_round, assert_close, flce_command,
    reference)

RTOL_CPU = 2e-4           # f32 dlogits (and every forward output)
RTOL_CPU_STORAGE = 2e-2   # gradients with --grad-logits storage (bf16/f16)
ARGMAX_GAP = 1e-3

GEMM_ENGINES = ("openblas", "onednn", "eigen")
FORWARD_OUTPUTS = ("loss", "lse", "logprob", "entropy", "zloss")
GRAD_OUTPUTS = ("grad_x", "grad_w", "grad_bias", "grad_logits")


@dataclasses.dataclass
class CpuCase(Case):
    grad_logits: Optional[str] = None   # None (flag omitted, = f32), f32, storage
    gemm: Optional[str] = None          # --gemm engine (None: backend's choice)
    out_f32: bool = False               # default (f32) outputs, not --out-dtype f64

    @property
    def storage(self):
        return "f32" if self.dtype is None else self.dtype

    @property
    def mode(self):
        """'f32' (f32 dlogits) or 'storage' (dlogits in the storage dtype)."""
        return "storage" if self.grad_logits == "storage" else "f32"

    def rtol(self, name):
        if (name in GRAD_OUTPUTS and self.mode == "storage"
                and self.storage != "f32"):
            return RTOL_CPU_STORAGE
        return RTOL_CPU


# --------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------

def _targeted_cases():
    C = CpuCase
    return [
        # Tile boundaries of the vocab dimension, both layouts.
        C("V1_opts", 1, N=9, H=17, V=1, zloss=0.1, smoothing=0.1, bias=True,
          grad_lse=True, grad_entropy=True),
        C("V511_hv_bias", 2, N=13, H=17, V=511, layout="hv", bias=True),
        C("V512_bf16", 3, N=11, H=17, V=512, dtype="bf16", bias=True,
          ignore_mode="some"),
        C("V513_f16_hv", 4, N=10, H=17, V=513, dtype="f16", layout="hv",
          smoothing=0.1),
        C("V1500_H300", 5, N=20, H=300, V=1500, bias=True, scale=0.5,
          zloss=1e-3, grad_lse=True),
        # Row blocks of up to 256 rows.
        C("N255_H1", 6, N=255, H=1, V=513, bias=True, ignore_mode="some"),
        C("N256_H17_bf16", 7, N=256, H=17, V=7, dtype="bf16",
          reduction="sum", token_weights="pos"),
        C("N257_H17_hv_f16", 8, N=257, H=17, V=1500, dtype="f16",
          layout="hv", bias=True, class_weights="mixed", ignore_mode="some",
          grad_entropy=True),
        C("N257_H1_storage_bf16", 9, N=257, H=1, V=512, dtype="bf16",
          grad_logits="storage", bias=True, smoothing=0.1),
        # Options.
        C("all_options_f32", 10, N=17, H=17, V=513, layout="hv", bias=True,
          scale=2.3, softcap=30.0, smoothing=0.7, zloss=0.1, ignore_index=7,
          ignore_mode="some", token_weights="mixed", class_weights="mixed",
          grad_loss=True, grad_lse=True, grad_entropy=True,
          label_dtype="int32"),
        C("all_options_bf16_storage", 11, N=17, H=300, V=511, dtype="bf16",
          grad_logits="storage", bias=True, scale=0.5, softcap=1.5,
          smoothing=0.1, zloss=1e-3, ignore_index=-1, ignore_mode="some",
          token_weights="pos", class_weights="pos", reduction="none",
          grad_loss=True, grad_lse=True, grad_entropy=True),
        C("all_options_f16_storage_hv", 12, N=31, H=17, V=1500, dtype="f16",
          grad_logits="storage", layout="hv", bias=True, scale=2.3,
          softcap=30.0, smoothing=0.7, zloss=0.1, ignore_mode="some",
          token_weights="mixed", class_weights="mixed", reduction="sum",
          grad_loss=True, grad_lse=True, grad_entropy=True),
        C("all_ignored_mean_cotangents", 13, N=6, H=17, V=513,
          ignore_mode="all", bias=True, zloss=0.1, smoothing=0.1,
          grad_loss=True, grad_lse=True, grad_entropy=True),
        C("all_ignored_sum_bf16_storage", 14, N=6, H=17, V=7,
          ignore_mode="all", ignore_index=-1, reduction="sum",
          dtype="bf16", grad_logits="storage", grad_lse=True),
        C("no_grad_f16", 15, N=40, H=300, V=1500, dtype="f16", grad=False,
          softcap=1.5, zloss=1e-3),
        C("explicit_grad_logits_f32_bf16", 16, N=12, H=17, V=1500,
          dtype="bf16", grad_logits="f32", bias=True, zloss=0.1),
        C("storage_with_f32_is_identity", 17, N=12, H=17, V=513,
          dtype="f32", grad_logits="storage", bias=True, softcap=30.0),
        C("big_logits_bf16_hv", 18, data="big", N=8, H=6, V=513,
          dtype="bf16", layout="hv", bias=True, zloss=1e-3, smoothing=0.1,
          grad_lse=True, grad_entropy=True),
        # Logits entry.
        C("logits_f32_all_options", 19, logits_entry=True, N=13, V=1500,
          scale=2.3, softcap=30.0, smoothing=0.1, zloss=0.1,
          ignore_mode="some", token_weights="mixed", class_weights="pos",
          grad_loss=True, grad_lse=True, grad_entropy=True),
        C("logits_bf16_storage_none", 20, logits_entry=True, N=9, V=513,
          dtype="bf16", grad_logits="storage", reduction="none",
          grad_loss=True, ignore_mode="some"),
        C("logits_f16_V1", 21, logits_entry=True, N=5, V=1, dtype="f16",
          grad_entropy=True),
        C("logits_N257_f16_storage", 22, logits_entry=True, N=257, V=511,
          dtype="f16", grad_logits="storage", smoothing=0.1,
          token_weights="pos"),
        # Default (f32) outputs.
        C("f32_outputs", 23, N=33, H=17, V=1500, bias=True, smoothing=0.1,
          zloss=1e-3, ignore_mode="some", grad_lse=True, grad_entropy=True,
          out_f32=True),
    ]


def _engine_cases():
    cases = []
    for i, eng in enumerate(GEMM_ENGINES):
        cases.append(CpuCase(
            f"gemm_{eng}_f32_hv", 60 + 2 * i, N=257, H=17, V=1500,
            layout="hv", bias=True, smoothing=0.1, zloss=1e-3,
            grad_lse=True, gemm=eng))
        cases.append(CpuCase(
            f"gemm_{eng}_bf16_storage_vh", 61 + 2 * i, N=40, H=300, V=513,
            dtype="bf16", grad_logits=("storage" if i != 1 else "f32"),
            bias=True, softcap=30.0, ignore_mode="some", gemm=eng))
        cases.append(CpuCase(
            f"gemm_{eng}_f16", 80 + i, N=20, H=17, V=511, dtype="f16",
            class_weights="pos", grad_entropy=True, gemm=eng))
    return cases


def _random_cases(count=16):
    cases = []
    for i in range(count):
        r = random.Random(9100 + i)
        logits_entry = r.random() < 0.2
        V = r.choice([1, 7, 511, 512, 513, 1500])
        H = r.choice([1, 17, 300])
        if r.random() < 0.2:
            N, H = r.choice([255, 256, 257]), r.choice([1, 17])
        else:
            N = r.randint(1, 48)
        ignore_mode = r.choice(["none", "some", "some", "all"])
        if ignore_mode == "all" and r.random() < 0.7:
            ignore_mode = "some"
        reduction = r.choice([None, "none", "sum", "mean"])
        grad = r.random() < 0.9
        cases.append(CpuCase(
            name=f"random{i:02d}", seed=1000 + i, N=N, H=H, V=V,
            layout=r.choice([None, "vh", "hv"]),
            dtype=r.choice([None, "f32", "bf16", "f16"]),
            grad_logits=r.choice([None, "f32", "storage", "storage"]),
            scale=r.choice([None, 1.0, 0.5, 2.3]),
            softcap=r.choice([None, 0.0, 1.5, 30.0]),
            ignore_index=r.choice([None, -1, 7, 3]), ignore_mode=ignore_mode,
            smoothing=r.choice([None, 0.0, 0.1, 0.7]),
            zloss=r.choice([None, 0.0, 1e-3, 0.1]),
            reduction=reduction,
            bias=(not logits_entry) and r.random() < 0.5,
            token_weights=r.choice([None, "pos", "mixed"]),
            class_weights=r.choice([None, "pos", "mixed"]),
            weight_file_dtype=r.choice(["f32", "f64"]),
            grad=grad,
            grad_loss=grad and r.random() < 0.5,
            grad_lse=grad and r.random() < 0.5,
            grad_entropy=grad and r.random() < 0.5,
            label_dtype=r.choice(["int32", "int64"]),
            logits_entry=logits_entry,
            threads=r.choice([None, None, 1, 2]),
        ))
    return cases


CASES = _targeted_cases() + _engine_cases() + _random_cases()


# --------------------------------------------------------------------------
# Running flce --backend cpu
# --------------------------------------------------------------------------

def _cpu_command(flce_bin, case, files, out_dir, out_dtype):
    extra = []
    if case.grad_logits is not None and case.grad:  # flce refuses it without --grad
        extra += ["--grad-logits", case.grad_logits]
    if case.gemm is not None:
        extra += ["--gemm", case.gemm]
    return flce_command(flce_bin, case, files, out_dir, out_dtype, backend="cpu", extra=extra)


_NOT_COMPILED = re.compile(r"not a GEMM engine compiled into this build")


def _write_inputs(d, directory):
    directory.mkdir(parents=True, exist_ok=True)
    files = {}
    for key, arr in d.items():
        path = directory / f"{key}.npy"
        np.save(path, arr)
        files[key] = str(path)
    return files


def run_cpu(flce_bin, case, d, tmp_path, out_dtype="f64", out_name="out",
            threads=None):
    files = _write_inputs(d, tmp_path / "in")
    out_dir = tmp_path / out_name
    if threads is not None:
        case = dataclasses.replace(case, threads=threads)
    cmd = _cpu_command(flce_bin, case, files, out_dir, out_dtype)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    report = (f"command: {' '.join(cmd)}\nexit code: {proc.returncode}\n"
              f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    if proc.returncode != 0:
        if case.gemm is not None and _NOT_COMPILED.search(proc.stderr):
            missing = f"GEMM engine {case.gemm} not compiled into {flce_bin}: {proc.stderr.strip()}"
            if os.environ.get("CI") == "true":  # .ci/deps installs every engine: a broken find
                pytest.fail(missing + " (under CI=true, where .ci/deps installs it)")
            pytest.skip(missing)
        pytest.fail(f"flce failed\n{report}")
    assert "backend: cpu" in proc.stdout, f"not run on the cpu backend\n{report}"
    return out_dir, report


# --------------------------------------------------------------------------
# Expected softcapped logits (for the argmax near-tie rule)
# --------------------------------------------------------------------------

def expected_s(case, d):
    """Float64 s = softcap(a * (x W^T + b)) from the storage-rounded inputs."""
    if case.logits_entry:
        z = case.a * _storage_round(d["logits"], case.dtype)
    else:
        x = _storage_round(d["x"], case.dtype)
        w = _storage_round(d["w"], case.dtype)
        w_vh = w.t() if case.layout == "hv" else w
        u = x @ w_vh.t()
        if case.bias:
            u = u + _storage_round(d["bias"], case.dtype)
        z = case.a * u
    s = case.k * torch.tanh(z / case.k) if case.k > 0 else z
    return s.numpy()


def check_argmax(case, d, got, report):
    s = expected_s(case, d)
    N, V = s.shape
    exp = np.argmax(s, axis=1)
    if V >= 2:
        top2 = np.sort(s, axis=1)[:, -2:]
        gap = top2[:, 1] - top2[:, 0]
    else:
        gap = np.full(N, np.inf)
    decisive = gap > ARGMAX_GAP
    bad = np.nonzero(decisive & (got != exp))[0]
    assert bad.size == 0, (
        f"argmax differs on rows {bad.tolist()} whose top-two gap exceeds "
        f"{ARGMAX_GAP}: got {got[bad].tolist()}, expected {exp[bad].tolist()}, "
        f"gaps {gap[bad].tolist()}\n{report}")
    assert np.all((got >= 0) & (got < V)), f"argmax out of range: {got}\n{report}"
    rows = np.arange(N)
    chosen = s[rows, got]
    far = np.nonzero(chosen < s.max(axis=1) - ARGMAX_GAP)[0]
    assert far.size == 0, (
        f"argmax on near-tie rows {far.tolist()} picks a class more than "
        f"{ARGMAX_GAP} below the maximum\n{report}")
    return int((~decisive).sum())


# --------------------------------------------------------------------------
# Worst relative errors, per storage dtype and dlogits mode
# --------------------------------------------------------------------------

_WORST = {}
_NEAR_TIES = [0, 0]  # rows exempt from exact argmax equality, rows checked


def _rel_err(got, expected):
    got = np.asarray(got, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    ref = float(np.linalg.norm(expected.ravel()))
    diff = float(np.linalg.norm((got - expected).ravel()))
    return diff / (ref if ref > 0.0 else 1.0)


def _record(case, name, rel):
    kind = "grad" if name in GRAD_OUTPUTS else "fwd"
    key = (case.storage, case.mode, kind)
    if rel > _WORST.get(key, (-1.0, ""))[0]:
        _WORST[key] = (rel, f"{case.name}:{name}")


@pytest.fixture(scope="module", autouse=True)
def _print_worst_errors():
    yield
    if _WORST:
        lines = ["", "worst norm-wise relative errors of flce --backend cpu "
                 "vs float64 torch (storage, dlogits, outputs):"]
        for key in sorted(_WORST):
            rel, where = _WORST[key]
            lines.append(f"  storage={key[0]:4s} dlogits={key[1]:7s} "
                         f"{key[2]:4s}: {rel:.3e}  ({where})")
        lines.append(f"argmax: {_NEAR_TIES[0]} of {_NEAR_TIES[1]} rows had a "
                     f"top-two gap <= {ARGMAX_GAP} (only checked to be "
                     f"within the gap)")
        print("\n".join(lines))


# --------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------

def check_cpu_outputs(case, d, out_dir, report, float_dtype):
    expected = reference(case, d)
    shapes = _expected_shapes(case, d)
    assert set(shapes) == set(expected)
    for name in GRAD_OUTPUTS:
        if name not in shapes:
            assert not (out_dir / f"{name}.npy").exists(), (
                f"unexpected {name}.npy written\n{report}")
    for name, shape in shapes.items():
        path = out_dir / f"{name}.npy"
        assert path.exists(), f"missing output {name}.npy\n{report}"
        got = np.load(path)
        assert got.shape == tuple(shape), (
            f"{name}: shape {got.shape} != expected {tuple(shape)}\n{report}")
        if name == "argmax":
            assert got.dtype == np.int64, f"argmax dtype {got.dtype}\n{report}"
            _NEAR_TIES[0] += check_argmax(case, d, got, report)
            _NEAR_TIES[1] += got.size
            continue
        assert got.dtype == float_dtype, (
            f"{name}: dtype {got.dtype} != {np.dtype(float_dtype)}\n{report}")
        _record(case, name, _rel_err(got, expected[name]))
        assert_close(name, got, expected[name], case.rtol(name), report)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_cpu_matches_torch_f64(flce_bin, case, tmp_path):
    d = _make_data(case)
    if case.out_f32:
        out_dir, report = run_cpu(flce_bin, case, d, tmp_path, out_dtype=None)
        check_cpu_outputs(case, d, out_dir, report, np.float32)
    else:
        out_dir, report = run_cpu(flce_bin, case, d, tmp_path, out_dtype="f64")
        check_cpu_outputs(case, d, out_dir, report, np.float64)


def test_case_coverage():
    """The case list covers what the acceptance check asks for."""
    assert {c.V for c in CASES} >= {1, 7, 511, 512, 513, 1500}
    assert {c.H for c in CASES} >= {1, 17, 300}
    assert {c.N for c in CASES} >= {255, 256, 257}
    assert {c.layout or "vh" for c in CASES if not c.logits_entry} == {"vh", "hv"}
    assert {(c.storage, c.mode) for c in CASES if c.grad} >= {
        (s, m) for s in ("f32", "bf16", "f16") for m in ("f32", "storage")}
    assert {c.gemm for c in CASES} >= set(GEMM_ENGINES)
    assert any(c.logits_entry for c in CASES)
    assert any(c.bias for c in CASES) and any(
        not c.bias and not c.logits_entry for c in CASES)
    assert {c.red for c in CASES} == {"none", "sum", "mean"}
    assert any(c.out_f32 for c in CASES)


def test_gemm_engines_compiled_in_are_covered(flce_bin, tmp_path):
    """Every engine the binary lists as compiled in is among GEMM_ENGINES
    (so the gemm_* cases cover all of them)."""
    case = CpuCase("probe", 5, N=2, H=3, V=4, gemm="no-such-engine")
    d = _make_data(case)
    files = _write_inputs(d, tmp_path / "in")
    cmd = _cpu_command(flce_bin, case, files, tmp_path / "out", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0, proc.stdout
    m = re.search(r"available: ([a-z0-9_, ]+)\)", proc.stderr)
    assert m, f"cannot parse the available engines from: {proc.stderr!r}"
    available = {e.strip() for e in m.group(1).split(",") if e.strip()}
    assert available, proc.stderr
    assert available <= set(GEMM_ENGINES), (
        f"engines {sorted(available - set(GEMM_ENGINES))} compiled in but not "
        f"covered by the gemm_* cases: {proc.stderr}")
    backends = subprocess.run([flce_bin, "backends"], capture_output=True,
                              text=True, timeout=60)
    assert backends.returncode == 0, backends.stderr
    assert backends.stdout.splitlines()[0].split()[0] == "cpu", backends.stdout


THREAD_CASES = [
    CpuCase("threads_f32", 4001, N=600, H=300, V=1500, layout="hv",
            bias=True, scale=2.3, softcap=30.0, smoothing=0.1, zloss=1e-3,
            ignore_mode="some", token_weights="mixed", class_weights="pos",
            grad_loss=True, grad_lse=True, grad_entropy=True),
    CpuCase("threads_bf16", 4002, N=600, H=300, V=1500, dtype="bf16",
            bias=True, softcap=1.5, smoothing=0.7, zloss=0.1,
            ignore_index=-1, ignore_mode="some", token_weights="pos",
            class_weights="mixed", reduction="sum", grad_lse=True,
            grad_entropy=True),
    CpuCase("threads_bf16_storage_none", 4003, N=600, H=17, V=1500,
            dtype="bf16", grad_logits="storage", bias=True, zloss=1e-3,
            ignore_mode="some", reduction="none", grad_loss=True),
]


@pytest.mark.parametrize("case", THREAD_CASES,
                         ids=[c.name for c in THREAD_CASES])
def test_cpu_threads_bitwise_identical(flce_bin, case, tmp_path):
    d = _make_data(case)
    outs, reports = {}, {}
    for t in (1, 2, 3):
        outs[t], reports[t] = run_cpu(flce_bin, case, d, tmp_path,
                                      out_dtype="f64", out_name=f"out_t{t}",
                                      threads=t)
    names = sorted(p.name for p in outs[1].iterdir())
    expected = {f"{n}.npy" for n in _expected_shapes(case, d)}
    assert set(names) == expected, (names, reports[1])
    for t in (2, 3):
        assert sorted(p.name for p in outs[t].iterdir()) == names, reports[t]
        differ = [n for n in names
                  if not filecmp.cmp(outs[1] / n, outs[t] / n, shallow=False)]
        assert not differ, (
            f"--threads {t} differs from --threads 1 in {differ}\n"
            f"{reports[1]}\n{reports[t]}")
