"""Shared fixtures for the Python cross-checks of the `flce` CLI.

Run with Debian's interpreter (the first `python3` on PATH may lack numpy/torch):

    /usr/bin/python3 -m pytest -q tests/python

The binary is taken from $FLCE_BIN, defaulting to build/flce in this checkout.
"""

import os

import pytest

DEFAULT_FLCE_BIN = os.path.normpath(
    os.path.join(os.path.dirname(__file__), "..", "..", "build", "flce"))

_DEPS_HINT = (
    "numpy and torch are required for tests/python; run them with Debian's "
    "interpreter, e.g. `/usr/bin/python3 -m pytest -q tests/python` "
    "(apt packages python3-numpy, python3-torch, python3-pytest)"
)


def _missing_deps():
    """Returns None when numpy and torch import, else a reason string."""
    try:
        import numpy  # noqa: F401
        import torch  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on environment
        return f"{_DEPS_HINT}: {exc}"
    return None


def pytest_configure(config):
    """Under CI=true (.ci/deps installs numpy and torch), a missing one stops
    the run: skipping every test would let the job pass."""
    reason = _missing_deps()
    if reason is not None and os.environ.get("CI") == "true":
        raise pytest.UsageError(f"{reason} (CI=true)")


@pytest.fixture(scope="session")
def python_deps():
    """Skips (with a clear message) when numpy or torch cannot be imported."""
    reason = _missing_deps()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def flce_bin(python_deps):
    """Path to the flce binary; skips every test using it when it is absent."""
    path = os.environ.get("FLCE_BIN", DEFAULT_FLCE_BIN)
    if not os.path.isfile(path):
        pytest.skip(
            f"flce binary not found at {path!r}: build it first "
            f"(cmake -S . -B build && cmake --build build) or set FLCE_BIN"
        )
    if not os.access(path, os.X_OK):
        pytest.skip(f"flce binary at {path!r} is not executable")
    return path
