"""Many sizes: the padding arithmetic (plan, outputs), the refusals and input errors (guards),
one graph per size in one pool (bucketed), and ``tr.graph`` itself (api), which returns a
one-shape or a many-size graph. Builds on ``core/``."""
