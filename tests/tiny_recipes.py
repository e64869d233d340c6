"""Override lists for the tiny models the training tests share (no imports: cheap at collection)."""

# LLaMA blocks with 4 routed experts, top-2; each test adds its own extras (shared experts, sequence length,
# expert parallelism).
TINY_MOE = [
    "model.type=moe",
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.ffn_hidden_size=64",
    "model.num_experts=4",
    "model.moe_top_k=2",
    "model.moe_ffn_hidden_size=32",
    "model.moe_aux_loss_coeff=1e-2",
]
