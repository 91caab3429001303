"""The reference engine: a toy-scale Qwen3-MoE served over SGLang 0.5.23's HTTP protocol.

Modules: ``config`` (model config), ``tokenizer`` (byte-level), ``model`` (PyTorch Qwen3-MoE
with per-request KV caches), ``checkpoint`` (the on-disk format), ``radix_cache`` (SGLang's
prefix cache), ``sampling`` (pure sampling math), ``reference`` (full-forward ground truth
for tests), ``protocol`` (request parsing and response shapes), ``scheduler`` (batched decode loop, pause modes, weight updates),
``server`` (FastAPI app), ``cli`` and ``launch`` (subprocess launcher; no torch import).
Only ``config``, ``tokenizer`` and ``launch`` are importable without torch.
"""
