"""Quality metrics on real text (the Austen corpus, perplexity, sentence-embedding cosine); may import kiln.core only.

- ``corpus``: Jane Austen's six novels (``make data``): calibration, search and confirmation slices.
- ``perplexity``: sliding-window perplexity of a causal language model.
- ``embedding``: mean-pooled, normalised sentence embeddings and their (mean) cosine.
- ``spread``: a mean paired loss difference and its confidence margin (z standard errors).
"""
