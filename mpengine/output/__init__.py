"""The output processor stage: detokenization, stop checks, deltas and feedback."""

from mpengine.output.detokenizer import Detokenizer
from mpengine.output.processor import OutputProcessor
from mpengine.output.stop import StopStrings

__all__ = ["Detokenizer", "OutputProcessor", "StopStrings"]
