"""LayerFusion: which consecutive layers share one sketch.

Sketching every layer alone gives small layers tiny, collision-ridden
sketches and one collective each; sketching the whole model as one lets the
largest layers take every heavy-hitter slot. The rule, with no knob:

    walk the layers in order and close a unit as soon as it holds at least
    as many elements as the largest layer; a tail that never gets there
    joins the previous unit.

So every unit is at least as large as the largest layer (which needs a unit
of its own size anyway) and smaller than three times that, units are contiguous
slices of the flat buffer (no copies), and the number of units adapts to
the model: total / largest, about.
"""


def layer_fusion(sizes: list) -> list:
    """(offset, length) of each unit for layers of ``sizes`` laid out in order."""
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError(f"layer sizes must be positive, got {sizes}")
    target = max(sizes)
    units, start, filled = [], 0, 0
    for s in sizes:
        filled += s
        if filled >= target:
            units.append((start, filled))
            start, filled = start + filled, 0
    if filled:
        if units:
            off, ln = units.pop()
            units.append((off, ln + filled))
        else:
            units.append((start, filled))
    return units
