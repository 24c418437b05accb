"""CPU library kernels: weight-only INT8 / INT4 matrix multiplication in C++ (``woq.h`` holds the kernels, ``woq.cpp`` their Python module)."""
