"""What every part of kiln shares and nothing else provides; imports no other part of kiln.

- ``cache``: the one cache folder (``$KILN_CACHE_DIR`` or ``~/.cache/kiln``).
- ``offline``: the one switch that keeps Hugging Face libraries off the network.
- ``native``: compiler, ISA flags, build keys, the shared SIMD headers (``include/``).
- ``compare``: numerical comparison (tolerances per dtype, SQNR) for verification and tests.
- ``hardware`` / ``calibrate``: device profiles for cost models, measured on this machine.
- ``memory``: this process's peak resident memory, and freed heap handed back to the OS.
- ``host_load``: the share of the CPU other processes used while something was timed.
"""
