"""Code generation: a ``Program`` of chosen kernels -> native code (``cpu/``: one C++ translation unit per model)."""
