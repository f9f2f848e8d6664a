"""moepass.cuda_ops: CUDA-side helpers (none yet; see README.md in this folder)."""
