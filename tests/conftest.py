"""Session-wide test setup, loaded before any test module.

Without a GPU, Triton kernels are tested through Triton's interpreter. TRITON_INTERPRET
must be set before the first ``triton.jit`` decoration *and* before anything (torch's
inductor included) makes Triton read its settings, so it is set here, first.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
