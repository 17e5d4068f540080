"""MARS (Mask AutoRegression): teach a causal LM to emit several tokens per forward pass.

The library is a set of small flat modules; import what you need from them directly
(``mars.masking``, ``mars.batch``, ``mars.loss``, ``mars.decoding`` ...). Nothing heavy is imported here
so that ``mars --help`` stays fast.
"""

__version__ = "0.1.0"
