"""vLLM plugin that wires the DDTree modules into an unmodified vLLM 0.26.0."""


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group; safe to call repeatedly.

    vLLM calls it in every process (API server before argument parsing, engine
    core, workers). It registers TREE_ATTN as ``AttentionBackendEnum.CUSTOM`` and
    installs the wrappers of :mod:`vllm_ddtree.glue`, which enable
    ``--speculative-config '{"method": "ddtree", ...}'``.
    """
    from vllm.v1.attention.backends.tree_attn import register_tree_attn_backend

    from vllm_ddtree import glue

    register_tree_attn_backend()
    glue.apply()
