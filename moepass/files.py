"""Names of the files in a moepass model directory (what convert and partition write)."""

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"           # every weight, as ONNX external data
REPORT_FILE = "moepass.json"            # hyperparameters, MoE layers, per-weight conversion report
PLAN_FILE = "plan.json"                 # partition: memory breakdown, residency, predictions
OPTIONS_FILE = "onnxruntime_options.json"  # partition: session config entries for ONNX Runtime
TOKENIZER_FILE = "tokenizer.json"       # convert: Hugging Face tokenizers file rebuilt from the GGUF
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # convert: chat template, BOS/EOS
GENAI_CONFIG_FILE = "genai_config.json"  # convert: what onnxruntime-genai needs to load the model
