"""What we know about each GPU type: supported clocks, power-limit range, idle power, voltage knee.

Read by the simulated backend, the trace simulator and the model replay; the NVML backend asks
the device, and a board the catalog lacks is described by its agent (`slurm_cdgpc.gpu.board`).
Reaches only `gpu/`, `wire/`, `errors` and `units` of the package
(`tests/unit/test_import_graph.py`). Test: `tests/unit/test_gpu_catalog.py`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.wire.board import ClockTable, PowerLimitRange


@dataclass(frozen=True)
class GpuSpec:
    """One GPU type as the simulator and the controller's priors see it."""

    name: str
    clocks: ClockTable
    power_limit: PowerLimitRange
    idle_power_w: float  # no job, persistence on, idle clock
    tdp_w: float
    # Voltage-floor knee: below it the voltage stays at its floor and power falls slowly with the
    # clock (P ≈ linear in f); above it the voltage rises and power grows ≈ f·V(f)².
    knee_mhz: float
    idle_graphics_mhz: int  # the SM clock an idle GPU reports
    # GetPowerUsage is a moving average over this window on Hopper (1 s); 0 = instantaneous.
    power_average_window_s: float = 0.0
    aliases: tuple[str, ...] = field(default=(), compare=False)
    # True for a type built from a board description with generic priors (`spec_from_board`)
    estimated: bool = False

    @property
    def max_graphics_mhz(self) -> int:
        return self.clocks.graphics_for()[0]

    @property
    def min_graphics_mhz(self) -> int:
        return self.clocks.graphics_for()[-1]

    @property
    def max_memory_mhz(self) -> int:
        return self.clocks.max_memory_mhz

    @property
    def memory_lockable(self) -> bool:
        """GDDR parts list several memory clocks; HBM parts one (memory locks are NOT_SUPPORTED)."""
        return len(self.clocks.memory_mhz) > 1


def _levels(max_mhz: int, min_mhz: int, step_mhz: float) -> tuple[int, ...]:
    """Descending clock list max, max−step, … ≥ min; fractional steps are floored (Volta: 7.5)."""
    count = round((max_mhz - min_mhz) / step_mhz) + 1
    return tuple(math.floor(max_mhz - k * step_mhz) for k in range(count))


def _table(lists: Mapping[int, tuple[int, ...]]) -> ClockTable:
    return ClockTable(
        memory_mhz=tuple(sorted(lists, reverse=True)), graphics_mhz=MappingProxyType(dict(lists))
    )


#: Every catalogued type. Each value is marked where it comes from: [measured] a device reported
#: it (``nvidia-smi`` output published with the clock tables in ``tests/data/nvml`` or in public
#: bug reports quoting ``nvidia-smi -q``); [fitted] fitted to the Perseus/Zeus measurements in
#: ``data/`` (see `slurm_cdgpc.gpu.plant`); [inferred] not measured for this exact part: taken
#: from a sibling part or a vendor figure. Clock lists are generated from max, min and step
#: (`_levels`); where a real list is known (V100-PCIE, A100-PCIE, H100 NVL in
#: ``data/gpu-clock-tables``; A10G, T4 and the A100-SXM4 in the telegraf ``nvidia-smi -q -x``
#: dumps of ``data/nvidia-smi-dumps``) the generator reproduces it exactly, and the catalog's
#: unit tests check it against the copies in ``tests/data/nvml``.
_SPECS: Final[tuple[GpuSpec, ...]] = (
    # V100-SXM2: mem 877 and max 1530 [measured a]; 7.5 MHz steps as on the measured
    # V100-PCIE list, down to 135 (the idle clock seen on V100-SXM2 [measured f]); limit 150–300 W
    # [measured a]; idle ~55 W [measured a, k]. Knee: the V100-PCIE fit (same GV100 silicon).
    GpuSpec(
        name="V100-SXM2",
        clocks=_table({877: _levels(1530, 135, 7.5)}),
        power_limit=PowerLimitRange(min_w=150.0, max_w=300.0, default_w=300.0),
        idle_power_w=55.0,
        tdp_w=300.0,
        knee_mhz=1005.0,
        idle_graphics_mhz=135,
        aliases=(
            "V100",
            "Tesla V100-SXM2-16GB",
            "Tesla V100-SXM2-32GB",
            "V100-SXM2-16GB",
            "V100-SXM2-32GB",
            "V100M16",  # Alibaba 2023 trace names
            "V100M32",
        ),
    ),
    # V100-PCIE-32GB: clock list [measured, gpu-clock-tables: 1380→135, 167 levels]; 250 W cap
    # [measured]; limit range 100–250 W [measured: the Zeus V100 sweep]; idle ~30 W [inferred:
    # the Zeus sweep's near-idle workloads draw 36–40 W]. Knee [fitted on the Zeus V100 sweep].
    GpuSpec(
        name="V100-PCIE-32GB",
        clocks=_table({877: _levels(1380, 135, 7.5)}),
        power_limit=PowerLimitRange(min_w=100.0, max_w=250.0, default_w=250.0),
        idle_power_w=30.0,
        tdp_w=250.0,
        knee_mhz=1005.0,
        idle_graphics_mhz=135,
        aliases=("V100-PCIE",),
    ),
    # A100-SXM4-80GB: mem 1593, max 1410 [measured c]; 15 MHz steps down to 210 [inferred from the
    # measured A100-PCIE list]; limit 100–400 W [measured c]; idle ~60 W [measured m]. Knee 1100
    # [fitted on Perseus; the data README's cruder fit says ≈1085]. Perseus's A100 drew 474 W, so
    # it was a 500 W board; this entry is the common 400 W one.
    GpuSpec(
        name="A100-SXM4-80GB",
        clocks=_table({1593: _levels(1410, 210, 15)}),
        power_limit=PowerLimitRange(min_w=100.0, max_w=400.0, default_w=400.0),
        idle_power_w=60.0,
        tdp_w=400.0,
        knee_mhz=1100.0,
        idle_graphics_mhz=210,
        aliases=("A100", "A100-SXM4", "A100-SXM", "A100-80GB", "A100-SXM-80GB", "A800-SXM4-80GB"),
    ),
    # A100-PCIE-40GB: clock list [measured, gpu-clock-tables: 1410→210, 81 levels]; 250 W cap
    # [measured]; min limit 150 W, idle ~35 W [inferred]; knee as A100-SXM4 (same GA100).
    GpuSpec(
        name="A100-PCIE-40GB",
        clocks=_table({1215: _levels(1410, 210, 15)}),
        power_limit=PowerLimitRange(min_w=150.0, max_w=250.0, default_w=250.0),
        idle_power_w=35.0,
        tdp_w=250.0,
        knee_mhz=1100.0,
        idle_graphics_mhz=210,
        aliases=("A100-PCIE",),
    ),
    # A40 (GDDR6): max clocks 1740/7251, limit 100–300 W default 300, idle 15–30 W in P8, idle
    # memory clock 405 [measured: an A40 `nvidia-smi -q` capture]. Graphics lists per memory clock
    # [inferred from an Ampere/Ada GDDR6 board (L4) that lists 15 MHz steps down to 210 at full
    # memory clock and 645→210 at 405 MHz]. Knee [fitted on Perseus].
    GpuSpec(
        name="A40",
        clocks=_table({7251: _levels(1740, 210, 15), 405: _levels(645, 210, 15)}),
        power_limit=PowerLimitRange(min_w=100.0, max_w=300.0, default_w=300.0),
        idle_power_w=25.0,
        tdp_w=300.0,
        knee_mhz=1140.0,
        idle_graphics_mhz=210,
        aliases=("NVIDIA A40",),
    ),
    # H100 SXM: mem 2619, max 1980, idle clock 345 [measured d]; 15 MHz steps down to 345
    # [inferred from the measured H100 NVL list]; limit 200–700 W [measured d, j]; idle ~79 W
    # [measured j, model not shown]. Knee [inferred: the A100/A40 fits put it at 0.66–0.78 of the
    # max clock; 0.7 × 1980]. GetPowerUsage is a 1 s average on Hopper [NVML docs].
    GpuSpec(
        name="H100-SXM",
        clocks=_table({2619: _levels(1980, 345, 15)}),
        power_limit=PowerLimitRange(min_w=200.0, max_w=700.0, default_w=700.0),
        idle_power_w=79.0,
        tdp_w=700.0,
        knee_mhz=1380.0,
        idle_graphics_mhz=345,
        power_average_window_s=1.0,
        aliases=("H100", "H100-SXM5", "H100-SXM5-80GB", "H100 80GB HBM3", "H800"),
    ),
    # H100 NVL: clock list for both memory clocks [measured, gpu-clock-tables: 1785→345, 97
    # levels]; 400 W cap [measured]; min limit 200 W, idle ~60 W, knee 0.7 × max [inferred].
    GpuSpec(
        name="H100-NVL",
        clocks=_table({2619: _levels(1785, 345, 15), 1593: _levels(1785, 345, 15)}),
        power_limit=PowerLimitRange(min_w=200.0, max_w=400.0, default_w=400.0),
        idle_power_w=60.0,
        tdp_w=400.0,
        knee_mhz=1245.0,
        idle_graphics_mhz=345,
        power_average_window_s=1.0,
        aliases=("H100 NVL", "H100 NVL (94GB)"),
    ),
    # H200 SXM: mem 3201, max 1980, idle clock 345 [measured e]; 700 W TDP [vendor figure]; steps,
    # lowest clock, min limit 200 W, idle ~80 W and knee [inferred from H100 SXM].
    GpuSpec(
        name="H200",
        clocks=_table({3201: _levels(1980, 345, 15)}),
        power_limit=PowerLimitRange(min_w=200.0, max_w=700.0, default_w=700.0),
        idle_power_w=80.0,
        tdp_w=700.0,
        knee_mhz=1380.0,
        idle_graphics_mhz=345,
        power_average_window_s=1.0,
        aliases=("H200-SXM", "H200-SXM5", "H200-SXM5-141GB", "H200 141GB HBM3e"),
    ),
    # --- more boards for the simulator. Sources as above, plus: (t) the telegraf nvidia-smi dumps
    # in data/nvidia-smi-dumps (a10g, tesla-t4, a100-sxm4-v12, rtx-4000-sff-ada-v13 .xml);
    # (i) mertside/ai-inference-energy H100_SUPPORT_SUMMARY.md; (o) pytorch/ao PR #4002 (B200
    # nvidia-smi clocks.max.mem); [vendor] = datasheet figures, not re-verified. GetPowerUsage is
    # a 1 s average on "Ampere (except GA100) or newer" [NVML docs], so every GA10x, Ada, Hopper
    # and Blackwell entry below averages (the older A40 entry above does not: kept as it was).
    #
    # A10G (GA102): both clock lists, limit 100–300 W, idle 25.6 W at 210/405 MHz in P8
    # [measured t]. Knee: the A40 fit's knee/max ratio, 0.655 × 1710 [inferred: same GA102 die].
    GpuSpec(
        name="A10G",
        clocks=_table({6251: _levels(1710, 210, 15), 405: _levels(420, 210, 15)}),
        power_limit=PowerLimitRange(min_w=100.0, max_w=300.0, default_w=300.0),
        idle_power_w=25.6,
        tdp_w=300.0,
        knee_mhz=1120.0,
        idle_graphics_mhz=210,
        power_average_window_s=1.0,
        aliases=("NVIDIA A10G",),
    ),
    # A10 (GA102, the 150 W PCIe card): max 1695 MHz, 150 W [vendor]; memory clocks and the
    # lists' structure, min limit 100 W [inferred from the measured A10G]; idle ~20 W [inferred:
    # below the A10G's 25.6 W]. Knee 0.655 × max as the A10G.
    GpuSpec(
        name="A10",
        clocks=_table({6251: _levels(1695, 210, 15), 405: _levels(420, 210, 15)}),
        power_limit=PowerLimitRange(min_w=100.0, max_w=150.0, default_w=150.0),
        idle_power_w=20.0,
        tdp_w=150.0,
        knee_mhz=1110.0,
        idle_graphics_mhz=210,
        power_average_window_s=1.0,
        aliases=("NVIDIA A10",),
    ),
    # T4 (Turing TU104): both clock lists (5001: 1590→300, 405: 645→300), limit 60–70 W
    # [measured t]. Idle ~10 W in P8 [inferred: the dump shows 26.8 W in P0 at 585 MHz, not
    # idle]; idle clock = the lowest listed [inferred]; knee 0.7 × max [inferred]. Turing
    # predates Ampere: GetPowerUsage is instantaneous.
    GpuSpec(
        name="T4",
        clocks=_table({5001: _levels(1590, 300, 15), 405: _levels(645, 300, 15)}),
        power_limit=PowerLimitRange(min_w=60.0, max_w=70.0, default_w=70.0),
        idle_power_w=10.0,
        tdp_w=70.0,
        knee_mhz=1110.0,
        idle_graphics_mhz=300,
        aliases=("Tesla T4", "NVIDIA T4"),
    ),
    # L4 (Ada AD104): max 2040 MHz, 72 W [vendor]; memory 6251 [inferred: 12.5 Gbps GDDR6].
    # Clock lists ESTIMATED: the memory-clock structure of the measured RTX 4000 SFF Ada (t: the
    # top memory clock, top − 200, 5001 and 810 each list every graphics clock down to 210; 405
    # lists 405→210). Min limit 40 W, idle ~16 W, knee 0.7 × max [inferred].
    GpuSpec(
        name="L4",
        clocks=_table(
            {
                6251: _levels(2040, 210, 15),
                6051: _levels(2040, 210, 15),
                5001: _levels(2040, 210, 15),
                810: _levels(2040, 210, 15),
                405: _levels(405, 210, 15),
            }
        ),
        power_limit=PowerLimitRange(min_w=40.0, max_w=72.0, default_w=72.0),
        idle_power_w=16.0,
        tdp_w=72.0,
        knee_mhz=1430.0,
        idle_graphics_mhz=210,
        power_average_window_s=1.0,
        aliases=("NVIDIA L4",),
    ),
    # L40S (Ada AD102): max 2520 MHz, 350 W [vendor]; memory 9001 [inferred: 18 Gbps GDDR6].
    # Clock lists ESTIMATED from the RTX 4000 SFF Ada structure as for the L4. Min limit 100 W,
    # idle ~35 W, knee 0.7 × max [inferred].
    GpuSpec(
        name="L40S",
        clocks=_table(
            {
                9001: _levels(2520, 210, 15),
                8801: _levels(2520, 210, 15),
                5001: _levels(2520, 210, 15),
                810: _levels(2520, 210, 15),
                405: _levels(405, 210, 15),
            }
        ),
        power_limit=PowerLimitRange(min_w=100.0, max_w=350.0, default_w=350.0),
        idle_power_w=35.0,
        tdp_w=350.0,
        knee_mhz=1765.0,
        idle_graphics_mhz=210,
        power_average_window_s=1.0,
        aliases=("NVIDIA L40S",),
    ),
    # A100-SXM4-40GB: the 81-level list 1410→210 [measured t on the SXM4-80GB, the same list as
    # the measured A100-PCIE-40GB]; memory 1215 [measured b: A100 40GB]; limit 100–400 W
    # [inferred from the SXM4-80GB]; idle 53 W [measured l: 52–54 W]; knee as A100-SXM4-80GB.
    GpuSpec(
        name="A100-SXM4-40GB",
        clocks=_table({1215: _levels(1410, 210, 15)}),
        power_limit=PowerLimitRange(min_w=100.0, max_w=400.0, default_w=400.0),
        idle_power_w=53.0,
        tdp_w=400.0,
        knee_mhz=1100.0,
        idle_graphics_mhz=210,
        aliases=("A100-SXM-40GB",),
    ),
    # H100 PCIe: memory 1593, 104 graphics levels 1755→210 in 15 MHz steps [measured i: a
    # summary of nvidia-smi output, the list itself not published]; 350 W [vendor]; min limit
    # 200 W, idle clock 345, idle ~50 W, knee 0.7 × max [inferred from H100 SXM/NVL].
    GpuSpec(
        name="H100-PCIE",
        clocks=_table({1593: _levels(1755, 210, 15)}),
        power_limit=PowerLimitRange(min_w=200.0, max_w=350.0, default_w=350.0),
        idle_power_w=50.0,
        tdp_w=350.0,
        knee_mhz=1230.0,
        idle_graphics_mhz=345,
        power_average_window_s=1.0,
        aliases=("H100 PCIe", "H100-PCIE-80GB"),
    ),
    # B200 (HGX/DGX, Blackwell): memory 3996 [measured o]; max 1965 MHz, 1000 W [vendor]; steps,
    # lowest clock 345, min limit 200 W [inferred from H100/H200]; idle ~110 W [inferred: 11 % of
    # the limit, as H100 SXM]; knee 0.7 × max [inferred]. Boards also ship at lower limits (a
    # benchmark script pins B200s at 750 W: facebookexperimental/triton PR #2023).
    GpuSpec(
        name="B200",
        clocks=_table({3996: _levels(1965, 345, 15)}),
        power_limit=PowerLimitRange(min_w=200.0, max_w=1000.0, default_w=1000.0),
        idle_power_w=110.0,
        tdp_w=1000.0,
        knee_mhz=1375.0,
        idle_graphics_mhz=345,
        power_average_window_s=1.0,
        aliases=("NVIDIA B200", "B200-SXM", "B200 180GB"),
    ),
)


def _key(name: str) -> str:
    """Case-, separator- and vendor-insensitive: 'NVIDIA A100 SXM4_80GB' → 'a100-sxm4-80gb'."""
    key = name.strip().lower()
    for prefix in ("nvidia ", "tesla "):
        key = key.removeprefix(prefix)
    return "-".join(key.replace("_", " ").replace("-", " ").split())


_BY_KEY: Final[Mapping[str, GpuSpec]] = MappingProxyType(
    {_key(name): spec for spec in _SPECS for name in (spec.name, *spec.aliases)}
)

CATALOG: Final[Mapping[str, GpuSpec]] = MappingProxyType({spec.name: spec for spec in _SPECS})
"""Every known GPU type by its canonical name."""


def catalog_spec(name: str) -> GpuSpec:
    """The GPU type called ``name`` (canonical name, NVML product name or a common alias).

    >>> catalog_spec("NVIDIA A100-SXM4-80GB").name
    'A100-SXM4-80GB'
    """
    try:
        return _BY_KEY[_key(name)]
    except KeyError:
        raise InputError(f"unknown GPU type {name!r} (known: {', '.join(CATALOG)})") from None
