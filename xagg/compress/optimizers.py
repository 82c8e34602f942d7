"""Which optimizers train a model, for ``--compress auto``.

A sparse method's sum carries a few coordinates a step; the rest wait in
its residual and arrive later, summed over the steps they waited. An
optimizer that divides each coordinate's step by its own history (Adam,
AdamW, Adagrad, RMSprop, ...) moves a coordinate that arrives once in a
hundred steps by one bounded step then, and nothing in the steps between;
SGD moves it by what arrives. Either way a sparse step trains less far
than one of exact sums: every method counts its own ``STEPS``, measured
under SGD where the loss is stable (scripts/steps_to_loss.py: rgc 1.3-1.7x
exact sums' steps on the bench's digits models). On a GPT under AdamW the
same methods trained as far as those counts say (mstopk's 100 steps as far
as the dense sum's 69-75, iwp's as its 53). Counted only that, a trial at
1 Gbit/s ran sparse methods for a window each before keeping the plain
hook in 16-bit lanes, and those steps cost the loss (docs/compression.md);
counted twice more (Auto's ``sparse_steps``, default 2) the plain hook
runs first and no sparse method could beat it, so none runs, while on
slow links, where a sparse step is many times faster, they still win.
``sparse_steps=1`` counts the methods' own ``STEPS`` alone.

The optimizers are seen as they are built (``install`` wraps
``torch.optim.Optimizer.__init__``, which every torch optimizer calls);
auto asks at the model's first forward, after most scripts build theirs.
"""
from __future__ import annotations

import weakref

import torch

_built: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_orig: dict = {}


def install() -> None:
    """Record every optimizer built from now on (idempotent)."""
    if _orig:
        return
    _orig["init"] = init = torch.optim.Optimizer.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _built.add(self)

    torch.optim.Optimizer.__init__ = __init__


def uninstall() -> None:
    if _orig:
        torch.optim.Optimizer.__init__ = _orig.pop("init")


def rescales(opt) -> bool:
    """Whether ``opt`` scales each coordinate's step by that coordinate's own
    history: every optimizer but SGD's family (torch's SGD and its
    subclasses, or a class named for it, such as a fused SGD)."""
    return not (isinstance(opt, torch.optim.SGD) or "sgd" in type(opt).__name__.lower())


def rescaling(module: torch.nn.Module) -> list[str]:
    """The class names of the optimizers built so far that hold a parameter
    of ``module`` and rescale per coordinate, sorted."""
    mine = {id(p) for p in module.parameters()}
    return sorted({type(opt).__name__ for opt in list(_built) if rescales(opt)
                   and any(id(p) in mine for g in opt.param_groups for p in g["params"])})


def rescale_said(names: list[str]) -> str:
    """``names`` as the subject of what they do to a sparse sum."""
    return f"{' and '.join(names)} scale{'s' if len(names) == 1 else ''} each coordinate's step by its own history"
