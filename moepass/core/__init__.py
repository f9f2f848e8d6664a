"""The facts every other part of moepass builds on, importing nothing else of moepass.

GGUF reading (gguf_reader), the per-GGUF-type table (quants), the per-architecture table
(architectures), MoE node layout and queries (moe_nodes), metadata and ONNX Runtime names (keys),
file names and model loading (files), importance matrices (imatrix), errors and the version.
"""
