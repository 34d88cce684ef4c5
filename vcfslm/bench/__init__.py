"""The benchmark: the rank worker (torch/transformers), its probe, placement facts and the
local driver. `import vcfslm.bench` stays cheap: only the worker-side modules
(`model`, `engine`, `probe`, `worker`) import torch, and only when they are imported.
"""
