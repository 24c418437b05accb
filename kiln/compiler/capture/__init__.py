"""Capture: PyTorch model -> kiln primitive Graph (torch.export + lowering)."""

from kiln.compiler.capture.builder import CaptureError
from kiln.compiler.capture.export import CaptureResult, Fallback, capture, fallback_report

__all__ = ["CaptureError", "CaptureResult", "Fallback", "capture", "fallback_report"]
