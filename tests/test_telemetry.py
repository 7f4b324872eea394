"""OpenVINO's usage telemetry is off in the engine's processes (engine.telemetry). Nothing here
sends: the checks read the consent OpenVINO's telemetry would act on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engine.telemetry import KEEP_DEFAULT

CONSENT = """
from openvino_telemetry.utils.opt_in_checker import OptInChecker
print(OptInChecker().check(False, True).name)
"""


def consent(tmp_path: Path, code: str, **env: str) -> str:
    """What OpenVINO's telemetry would decide in a fresh process for a user who never answered
    (an empty home, not in CI)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "TF_BUILD", "JENKINS_URL", KEEP_DEFAULT)}
    done = subprocess.run(
        [sys.executable, "-c", code + CONSENT],
        env={**clean, "HOME": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[1],
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()[-1]


def test_importing_the_engine_declines_what_openvino_would_send_unasked(tmp_path):
    assert consent(tmp_path, "") == "NO_FILE"  # (OpenVINO's default: it sends, asking nobody)
    assert consent(tmp_path, "import engine, openvino") == "DECLINED"
    assert consent(tmp_path, "import engine", **{KEEP_DEFAULT: "1"}) == "NO_FILE"
