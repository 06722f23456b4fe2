"""Shipped Hugging Face config.json files of public models (``mpsim trace --hf NAME``),
installed as the package ``mpsim.data.hf_configs``."""
