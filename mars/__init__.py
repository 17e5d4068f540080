"""MARS (Mask AutoRegression): teach a causal LM to emit several tokens per forward pass.

The library is one subpackage per phase: ``core`` (mask, batch, loss), ``training``, ``decoding``,
``evaluation`` and ``release``; ``mars.cli`` is the command-line layer over them. Import what you need
from the modules directly. Nothing heavy is imported here so that ``mars --help`` stays fast.
"""

__version__ = "0.1.0"
