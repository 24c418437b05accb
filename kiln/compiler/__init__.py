"""The small-model compiler: capture -> primitives -> fused kernels chosen by a BLP -> one native program; may import kiln.core and kiln.kernels only.

``kiln.compile`` is ``api.compile``; ``backend.py`` registers kiln as a ``torch.compile``
backend. Stages, in pipeline order: ``capture/`` (torch.export, fission into primitives),
``ir/`` (the primitive graph, layouts, each primitive's semantics), ``fusion/`` (candidate
kernels, costs, the BLP and greedy baseline, schedule, memory plan), ``codegen/cpu/`` (one
C++ translation unit per model), ``exec/`` (executors, verification, reports).
"""
