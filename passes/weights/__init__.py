"""How GGUF tensors become ONNX initializers: streamed, chunk by chunk, with a conversion record.

Each initializer is a `StreamedTensor`: when onnx-ir's writer saves the model it calls
`tofile()`, which reads a few MiB of source rows, converts them (repack, requantize or
dequantize) and writes them, then the next few. No tensor is ever whole in memory, so peak
memory is set by CHUNK_BYTES, not by the size of the model or of its largest tensor.

Every group of initializers made from GGUF tensors gets a `WeightRecord` in the `WeightReport`:
sources, their types, the target form, bytes, and (once written) whether each source moved
bit-exactly and its relative RMS error against the gguf package's dequantization.
"""
