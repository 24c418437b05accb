"""Hand-written library kernels, each beside its reference; may import kiln.core only.

- ``formats``: the INT8 / INT4 weight formats (packing, checks, group sizes, dequantization).
- ``registry``: one map (format, device) -> weight-only kernel.
- ``cpu/``: the C++ weight-only kernels (AVX2 / AVX-512).
- ``gpu/``: Triton weight-only kernels and 2:4 sparse linears.
"""
