"""No compression: the baseline in the compression hook (auto's per-bucket
``dense``, the hook API's). ``xagg-client run --compress none`` runs the plain
hook instead, which sums the same float32 values faster (xagg.torch.patch)."""
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
