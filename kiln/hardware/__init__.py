"""Device profiles: what the cost model needs to know about the machine.

``load_profile()`` returns this machine's calibrated ``HardwareProfile`` (cached on
disk); ``reference_cpu_profile()`` a fixed one for tests and offline planning.
"""

from kiln.hardware.profile import (
    HardwareProfile,
    cache_dir,
    gemm_shape_class,
    load_profile,
    reference_cpu_profile,
)

__all__ = [
    "HardwareProfile",
    "cache_dir",
    "gemm_shape_class",
    "load_profile",
    "reference_cpu_profile",
]
