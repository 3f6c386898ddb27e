"""LLM post-training pruning: block-wise SAFE / SAFE+, magnitude, Wanda, SparseGPT.

Flax-examples layout: ``model.py`` (LLaMA decoder), ``checkpoints.py``
(safetensors / GGUF loaders), ``export.py`` (the Hugging Face folder with its
sparsity metadata), ``data.py`` (calibration
and perplexity windows), ``prune.py`` (the sequential block engine), ``cli.py``
(the ``safe-optax-llm`` command). Needs the ``llm`` extra.
"""
