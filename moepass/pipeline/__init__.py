"""The stages the commands are made of: the GGUF conversion (`conversion`: a GGUF lowered, then its
folder written), the KV cache's type (`kv_precision`), the files beside a model (`tokenizer`,
`genai`), the placement's memory model and plan (`placement`, `popularity`, `plan_report`), and the
atomic writing of every output (`atomic`). A stage imports stages, passes, runtime and core; never a
command (moepass.convert, moepass.partition, ...) nor the CLI."""
