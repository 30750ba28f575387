"""Optional bridges to other libraries, each imported only when used:

- :mod:`attnfast.integrations.transformers`: the "attnfast" attention backend for Hugging Face
  transformers (``pip install "attnfast[transformers]"``).
"""
