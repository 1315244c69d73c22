"""`python -m benchmarks.versus_nemo`: `image-edit-data bench` with NVIDIA NeMo Automodel's loader beside ours.

Every option is the bench's (`image-edit-data bench --help`), plus `--reference-path DIR` to import
NeMo Automodel from an unpacked wheel instead of the environment. Its loader is timed on the same
cache, its index opened and its workers' memory followed over an epoch, next to ours (`nemo.py`).
"""
