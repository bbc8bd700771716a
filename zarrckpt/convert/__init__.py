"""Conversions to and from other formats (rule: built on the public face; nothing below imports it).

``export``: tensors as (sharded) Hugging Face safetensors; ``importer``: DCP directories,
``torch.save`` files and safetensors into zarrckpt; ``safetensors``: the checked, memory-mapped reader.
"""
