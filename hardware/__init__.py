"""Facts about machines and what single operations cost on them: chips, collectives, roofline.

The chip table lives in ``hardware/chips.toml``; ``hardware.probe`` measures this machine (torch,
imported lazily).
"""

from hardware.chips import (
    CHIPS,
    DTYPE_BYTES,
    Chip,
    ChipTableError,
    UnknownChipError,
    chip_fields,
    get_chip,
    load_chips,
)
from hardware.collectives import (
    Hierarchy,
    Link,
    Ring,
    Switch,
    Topology,
    Torus,
    TorusAxis,
    group_topology,
    hierarchy,
    ring,
    switch,
    torus,
)
from hardware.probe import ProbeResult, as_chip, measure_this_machine
from hardware.roofline import MatmulCost, matmul_cost, ridge_point, roofline_curve

__all__ = [
    "CHIPS",
    "DTYPE_BYTES",
    "Chip",
    "ChipTableError",
    "Hierarchy",
    "Link",
    "MatmulCost",
    "ProbeResult",
    "Ring",
    "Switch",
    "Topology",
    "Torus",
    "TorusAxis",
    "UnknownChipError",
    "as_chip",
    "chip_fields",
    "get_chip",
    "group_topology",
    "hierarchy",
    "load_chips",
    "matmul_cost",
    "measure_this_machine",
    "ridge_point",
    "ring",
    "roofline_curve",
    "switch",
    "torus",
]
