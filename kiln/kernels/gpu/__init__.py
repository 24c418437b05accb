"""GPU kernels (Triton) and GPU paths for compressed linear layers.

- ``woq``: weight-only INT8 / INT4 GEMMs that dequantize inside the loop (Triton).
- ``sparse24``: 2:4 semi-structured sparse linear through torch's sparse tensor cores.

Each kernel file runs its reference (plain torch) off the GPU; Triton kernels also run on the
CPU under ``TRITON_INTERPRET=1`` for tests.
"""
