"""moepass: Mixture-of-Experts GGUF models -> ONNX decoders with com.microsoft::QMoE experts."""

__version__ = "0.1.0"
