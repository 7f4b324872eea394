"""OpenVINO's usage telemetry, kept off in the engine's processes.

``import openvino`` imports its model-conversion package, which sends a usage event to Google
Analytics from every process, asking nobody (its opt-in dialog is off), unless the user opted out
with OpenVINO's ``opt_in_out --opt_out`` or ``CI=true`` is set. A chat server that people start on
their own machines should not report each start, so importing the engine declines it for the
process (the user's own setting is left as it is). ``SPECCHAT_OPENVINO_TELEMETRY=1`` keeps
OpenVINO's default.
"""

from __future__ import annotations

import os

KEEP_DEFAULT = "SPECCHAT_OPENVINO_TELEMETRY"


def decline_openvino_telemetry() -> bool:
    """Make OpenVINO's telemetry find no consent in this process; whether it was declined."""
    if os.environ.get(KEEP_DEFAULT) == "1":
        return False
    try:
        from openvino_telemetry.utils.opt_in_checker import ConsentCheckResult, OptInChecker
    except ImportError:  # (no telemetry package: nothing to decline)
        return False
    OptInChecker.check = lambda self, *args, **kwargs: ConsentCheckResult.DECLINED
    return True
