"""bench/cuda_targets.py: the GPU benchmark's check of issue #7's targets,
on made-up benchmark rows (no GPU, torch or flce needed): each limit is the
issue's, inclusive for the ratios and the memory, strict for eager."""

import importlib.util
import os

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "cuda_targets.py")
_SPEC = importlib.util.spec_from_file_location("cuda_targets", _PATH)
targets = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(targets)

MIB = 1 << 20


def row(h, step_ratio, fwd_ratio, extra_mib=100, eager_ms=100.0, step_ms=50.0,
        back_to_back=None, key=""):
    grads = (8192 * h + 128256 * h) * 2
    return {"shape": f"h{h}", "n": 8192, "h": h, "v": 128256, "grads_bytes": grads,
            "eager_ms": eager_ms,
            "back_to_back": back_to_back or [],
            "flce": [{"variant": key or "default", "key": key, "step_ratio": step_ratio,
                      "fwd_ratio": fwd_ratio, "step_ms": step_ms,
                      "step_peak_extra_bytes": grads + extra_mib * MIB}]}


def met(r, what):
    return {c[0]: c[3] for c in targets.checks(r)}[what]


def test_limits_follow_the_hidden_size():
    assert targets.ratio_limits(2304) == (1.25, 1.15)
    assert targets.ratio_limits(4096) == (1.25, 1.15)
    assert targets.ratio_limits(1024) == (1.5, 1.3)


def test_ratios_are_met_up_to_and_at_the_limit():
    assert met(row(2304, 1.25, 1.15), "step / 3 GEMMs, shuffled")
    assert met(row(2304, 1.25, 1.15), "forward / GEMM, shuffled")
    assert not met(row(2304, 1.2501, 1.1501), "step / 3 GEMMs, shuffled")
    assert not met(row(2304, 1.2501, 1.1501), "forward / GEMM, shuffled")
    assert met(row(1024, 1.45, 1.29), "step / 3 GEMMs, shuffled")
    assert not met(row(1024, 1.51, 1.31), "forward / GEMM, shuffled")


def test_memory_bound_is_the_gradients_plus_512_mib():
    assert met(row(2304, 1.0, 1.0, extra_mib=512), "step extra memory, MiB")
    assert not met(row(2304, 1.0, 1.0, extra_mib=513), "step extra memory, MiB")


def test_the_step_must_beat_eager():
    assert met(row(2304, 1.0, 1.0, eager_ms=50.1, step_ms=50.0), "eager step / flce step")
    assert not met(row(2304, 1.0, 1.0, eager_ms=50.0, step_ms=50.0), "eager step / flce step")


def test_back_to_back_rounds_are_checked_one_by_one_for_the_variant():
    rounds = [{"gemm1": 10.0, "gemm_x": 10.0, "gemm_w": 10.0, "step x": 36.0, "fwd x": 11.0,
               "step ": 99.0, "fwd ": 99.0},
              {"gemm1": 10.0, "gemm_x": 10.0, "gemm_w": 10.0, "step x": 39.0, "fwd x": 12.0,
               "step ": 99.0, "fwd ": 99.0}]
    checks = {c[0]: c for c in targets.checks(row(4096, 1.0, 1.0, back_to_back=rounds, key="x"))}
    assert abs(checks["step / 3 GEMMs, back to back 1"][1] - 1.2) < 1e-12
    assert checks["step / 3 GEMMs, back to back 1"][3]
    assert checks["forward / GEMM, back to back 1"][3]
    assert not checks["step / 3 GEMMs, back to back 2"][3]
    assert not checks["forward / GEMM, back to back 2"][3]


def test_report_counts_what_was_met():
    lines = targets.report([row(2304, 1.3, 1.1), row(1024, 1.4, 1.2)])
    assert lines[-1] == "7 of 8 checks met"
    assert any("step / 3 GEMMs, shuffled: 1.300 (at most 1.250): NOT met" in l for l in lines)


ORACLE = "outputs at 8 rows, fraction of the policy's bound"


def test_outputs_must_agree_with_the_oracle():
    r = row(2304, 1.0, 1.0)
    assert ORACLE not in {c[0] for c in targets.checks(r)}  # runs from before the check
    r["oracle"] = {"step lse": 0.02, "step grad_x": 1.0, "fwd lse": 0.01}
    assert met(r, ORACLE)
    r["oracle"]["step grad_x"] = 1.0001
    assert not met(r, ORACLE)
    r["oracle"] = {"error": "flce.testing.assert_close: 1 output(s) outside the policy"}
    assert not met(r, ORACLE)
    lines = targets.report([r])
    assert lines[-1] == "4 of 5 checks met"


def test_outputs_outside_the_policy_fail_the_run():
    ok, over, wrong, old = (row(2304, 1.0, 1.0) for _ in range(4))
    ok["oracle"] = {"step lse": 0.02, "masked step grad_w": 1.0}
    over["oracle"] = {"step lse": 0.02, "masked step grad_w": 1.5}
    wrong["oracle"] = {"error": "masked step: 3 grad_x entries of ignored rows are not 0"}
    assert targets.oracle_failures([ok, old]) == []  # old: a run from before the check
    assert targets.oracle_failures([ok, over, wrong]) == [
        "h2304: 1.500 of a bound",
        "h2304: masked step: 3 grad_x entries of ignored rows are not 0"]
