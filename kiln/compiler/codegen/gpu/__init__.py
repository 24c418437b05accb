"""GPU code generation: an orchestrated program as Triton kernels plus ATen calls.

``codegen.generate`` turns each chosen kernel into one Triton kernel from a template
(``pointwise``, ``rows`` for reductions, ``gemm`` for one GEMM or a chain of GEMMs
with fused epilogues, ``attention``) or, for what no template covers (convolutions,
opaque ops, gathers), a call to the ATen op on the device. ``exec.gpu`` runs the
result and replays it as one CUDA graph.
"""
