"""No compression: the baseline, and what ``--compress none`` means."""
from dataclasses import dataclass

from xagg.compress.base import Compressor, Part, Payload


@dataclass
class Dense(Compressor):
    """dense - the float32 sum as is (1x)."""
    NAME = "dense"
    SUMMABLE = True

    def compress(self, name, tensor, step, **ctx):
        return Payload({"x": Part("sum", tensor)}, final=True)

    def decompress(self, name, p, step):
        return p["x"]
