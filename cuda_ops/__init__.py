"""moepass.cuda_ops: what ONNX Runtime's CUDA kernels need from moepass (see README.md in this folder):
the SM80 prepacked weight layout of QMoE (`prepack`)."""
