"""fmoe: a functional trainer for mixture-of-experts language models.

A model is a list of pure stage functions ``forward(params, inputs, ctx) -> outputs``; fmoe derives
each stage's forward (F), input-gradient (B) and weight-gradient (W) callables, and runs them in the
order a schedule table gives.
"""

__version__ = "0.1.0"
