"""dflash-trt: block-diffusion speculative decoding (DFlash, arXiv 2602.06036) for LLM serving.

Subpackages: `models` (target, drafter, loading), `runtime` (KV caches, proposer, verifier,
decode loop), `cli` (the `dflash-trt` command). Heavy optional backends import lazily.
"""

__version__ = "0.1.0"
