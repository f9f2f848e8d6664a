"""Every name moepass writes into a model or hands to ONNX Runtime, in one place.

moepass's own metadata lives in ONNX `metadata_props` under the "moepass." namespace, on the model
and on the nodes it makes; ONNX Runtime's names are session config entries and the node annotation
its layer assignment reads (docs/gpu.md says from which release each one is honoured).
"""

from __future__ import annotations

# ---- model metadata_props ----------------------------------------------------------------------
PREFIX = "moepass."
VERSION = "moepass.version"
ARCHITECTURE = "moepass.architecture"  # the GGUF architecture name
SOURCE = "moepass.source"  # the converted file's name
MOE_LAYERS = "moepass.moe_layers"  # how many MoE nodes the conversion made
FEATURES = "moepass.features"  # JSON: the architecture's switches and hyperparameters
ACTIVATIONS = "moepass.activations"  # "int8" or "float" (passes.activations)
PLACEMENT = "moepass.placement"  # JSON: partition's summary of the plan

# ---- node metadata_props -----------------------------------------------------------------------
LAYER = "moepass.layer"  # MoE node: its block number
EXPERT_FORM = "moepass.expert_form"  # MoE node: "int4/b32", "float32", ...
SOURCE_TYPES = "moepass.source_types"  # MoE node: the GGUF types of gate, up, down
FUSED_FROM = "moepass.fused_from"  # a fused node: the node its rule started from
PLACEMENT_PREFIX = "moepass.placement."
EXPERT_IDS = PLACEMENT_PREFIX + "expert_ids"  # MoE node: the original expert of each slot
RESIDENT = PLACEMENT_PREFIX + "resident"  # MoE node: how many leading slots stay on the GPU

# ---- graph outputs -----------------------------------------------------------------------------
ROUTER_LOGITS_PREFIX = "moepass.router_logits."  # + MoE node name: profile's exposed router logits

# ---- ONNX Runtime: layer assignment ------------------------------------------------------------
LAYER_ANNOTATION = "layer_ann"  # node metadata_props key ONNX Runtime matches rules against
LAYER_SETTINGS_KEY = "session.layer_assignment_settings"
# prefix rules: "gpu" and "gpu/blk.N.moe" go to the GPU EP, "cpu/blk.N.moe" to the CPU EP
LAYER_SETTINGS = "gpu(gpu); cpu(cpu)"

# ---- ONNX Runtime: expert offload (CUDA plugin EP) ---------------------------------------------
OFFLOAD_PREFIX = "session.moe.offload."
OFFLOAD_MODE = OFFLOAD_PREFIX + "mode"
OFFLOAD_PLACEMENT = OFFLOAD_PREFIX + "placement"
OFFLOAD_GPU_BUDGET = OFFLOAD_PREFIX + "gpu_budget_bytes"
OFFLOAD_NODE_OVERRIDES = OFFLOAD_PREFIX + "node_overrides"
# the values session.moe.offload.mode takes; a plan writes one of the last two
OFFLOAD_MODES = ("disabled", "auto", "required")

# ---- ONNX Runtime: other session entries -------------------------------------------------------
RECORD_ASSIGNMENT_KEY = "session.record_ep_graph_assignment_info"
EXTERNAL_DATA_FOLDER_KEY = "session.model_external_initializers_file_folder_path"


def layer_annotation(node: str, on_gpu: bool) -> str:
    """The layer_ann value of a MoE node (every other node is annotated "gpu")."""
    return f"{'gpu' if on_gpu else 'cpu'}/{node}"
