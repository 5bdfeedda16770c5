"""Native CPU kernels, compiled on first use with the system C compiler and loaded with ctypes."""
