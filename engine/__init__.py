"""SpecChat OV's engine. Importing it keeps OpenVINO's usage telemetry off (engine.telemetry)."""

from engine.telemetry import decline_openvino_telemetry

decline_openvino_telemetry()
