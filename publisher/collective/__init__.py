"""The collective data path: a version pushed by a broadcast (NCCL, gloo) or CUDA IPC."""
