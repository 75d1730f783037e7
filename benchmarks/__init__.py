"""cupyflash's asv benchmark suites (asv imports this directory as a package).

bench_cpu      the CPU path against naive NumPy attention (runs everywhere)
bench_gpu      the CUDA kernels (skip where CuPy sees no GPU)
bench_kernels  the static kernel report as tracked numbers (NVRTC, no GPU)

The other modules here (gpu_check, plot_results) are scripts, not suites.
No module initialises CUDA at import: CuPy is imported inside ``setup``.
"""
