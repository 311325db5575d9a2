"""Nereus: adaptive parallelism for LLM RL post-training.

`nereus.ir` (plan IR), `nereus.passes` (compiler passes) and the text/dot/JSON backends
import without torch or triton; `nereus.runtime` and `nereus.backends.triton` need them.
"""

__version__ = "0.1.0"
