"""vLLM plugin that wires the DDTree modules into an unmodified vLLM 0.26.0."""


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group; safe to call repeatedly.

    Registers TREE_ATTN as ``AttentionBackendEnum.CUSTOM``.
    """
    from vllm.v1.attention.backends.tree_attn import register_tree_attn_backend

    register_tree_attn_backend()
