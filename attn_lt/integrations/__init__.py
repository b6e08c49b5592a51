"""Adapters that plug attn_lt into other libraries. Each lives in its own module, imported only when used:

* ``attn_lt.integrations.transformers``: ``attn_implementation="attn_lt"`` in Hugging Face transformers
  (optional dependency: ``pip install 'attn-lt[transformers]'``).
"""
