"""The piecewise runtime: an ordered list of captured graph pieces and eager steps between them,
one memory pool and one set of static buffers for every piece and every size. No Dynamo in here:
``torchreplay.compile`` (the ``torch.compile`` backend) builds a :class:`Program` from an FX graph;
breakable graphs will build one from eager code."""

from torchreplay.pieces.program import Constant, Input, Piece, Program, Split
from torchreplay.pieces.runtime import PiecewiseRuntime

__all__ = ["Constant", "Input", "Piece", "Program", "Split", "PiecewiseRuntime"]
