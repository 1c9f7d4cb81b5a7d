"""The CUDA decode step's tuning decisions as data: `DecodePlan`, one frozen value an engine builds once and hands
to every launcher (`plan=`; None means `DecodePlan()`, the defaults below).

Each field is a number or a rule that a GPU model or a model shape may want otherwise: the attention's splits,
blocks and warps, the batch bounds of its short-context paths, its L2-prefetch programs per batch, the row bounds
of the projections' paths, where each kernel lets the next one launch (programmatic dependent launch), the
engine's fused and deferred batch ranges. The defaults are the choices measured on an H200 (docs/PERF_LOG.md
dates each one). `DecodePlan.for_gpu(name)` reads overrides from the "plan" section of that GPU model's step-tune
tables (`tune.table_files`: the shipped `configs/<GPU>.json`, then the user's `bitnet tune` table over it):

    {"plan": {"attn_programs_per_sm": 4, "attn_pf_table": [2048, 1024]}, "('auto', 2560, ...)": {...tile...}}

Fields documented as overrides (0 or -1: the rule's own choice) exist for benchmarks, which set them with
`dataclasses.replace(plan, ...)` or `plan.with_values(parse_values("attn_splits=8,attn_bs=32"))`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DecodePlan:
    # ---- the decode attention (attention.py) ----
    # programs a launch aims its splits at, per SM: 3 of its programs fill an SM (registers, shared memory)
    attn_programs_per_sm: int = 3
    # at these batches the default splits run 2 warps a program instead of 4, and over a float8 cache (1-byte
    # K/V blocks) aim at attn_narrow_programs_per_sm programs an SM
    attn_narrow_min_b: int = 8
    attn_narrow_max_b: int = 8
    attn_narrow_programs_per_sm: int = 4
    # from attn_late_min_b to attn_late_max_b rows the attention lets the next kernels launch only at its end,
    # so that its K/V reads compete with no early weight loads; beyond, early again, and the quantization launch
    # before o triggers after its own wait instead
    attn_late_min_b: int = 8
    attn_late_max_b: int = 32
    # a step captured for rows within attn_small_max_keys keys, up to attn_small_max_b rows, runs the default
    # splits over attn_small_bs-key blocks in attn_small_stages pipeline stages (spans of at most 32 keys, which
    # 64-key blocks would compute half masked)
    attn_small_max_b: int = 2
    attn_small_max_keys: int = 1024
    attn_small_bs: int = 32
    attn_small_stages: int = 2
    # ... and one within one attn_range_bs-key block, up to attn_range_max_b rows, one split of one block at
    # attn_range_warps warps: a small grid and no merge (from 5 rows the default splits measured faster)
    attn_range_max_b: int = 4
    attn_range_bs: int = 256
    attn_range_warps: int = 8
    # programs added past the splits that pull later weights into L2 while DRAM idles, per batch (batch 1, 2,
    # ...; past the end: none), over a float8 cache and over a bf16 one (twice the K/V bytes: batch 1 lost)
    attn_pf_table: tuple[int, ...] = (2048, 2048, 1024, 512, 2048, 2048, 2048, 2048)
    attn_pf_table_kv16: tuple[int, ...] = (0, 2048, 2048, 1024, 2048, 2048, 2048, 2048)
    # the counts the step tuner tries besides the table's (batch 1's optimum is narrow)
    attn_pf_counts: tuple[int, ...] = (0, 512, 1024, 2048, 3072)
    # 128-byte lines a prefetch vector
    attn_pf_block: int = 512
    # up to this batch the prefetch also pulls the next layer's q|k|v, at these batches the layer's down
    attn_pf_qkv_max_b: int = 1
    attn_pf_down_batches: tuple[int, ...] = (2,)
    # benchmarks' overrides (0: the rules above): splits a row and kv head, keys a block, pipeline stages,
    # warps, a register cap, programs a launch; attn_pf_programs -1: the table, 0: none, n: n up to batch 32
    attn_splits: int = 0
    attn_bs: int = 0
    attn_stages: int = 0
    attn_warps: int = 0
    attn_maxnreg: int = 0
    attn_programs: int = 0
    attn_pf_programs: int = -1
    # ---- the projections (launch.py, decode.py) ----
    # up to row_max_m rows the row GEMVs come first (dp4a work grows with the rows), up to gemv_max_m the dp4a
    # GEMVs are candidates, up to splitk_max_m the split-K GEMM runs, above it the tiled GEMM, which up to
    # splitk_prefill_max_m rows is timed against the swapped split-K tiles
    row_max_m: int = 2
    gemv_max_m: int = 16
    splitk_max_m: int = 64
    splitk_prefill_max_m: int = 256
    # a quantizing row GEMV loads its norm weights before its PDL wait up to this K (registers held across it)
    early_norm_max_k: int = 8192
    # a plain row GEMV wider than this splits a program's rows in two parts where its grid leaves SMs idle
    row_tiles_min_k: int = 4096
    # the quantization launch runs 8 warps up to quant_narrow_max_m rows of at most quant_wide_k values, else 16
    quant_wide_k: int = 4096
    quant_narrow_max_m: int = 16
    # from quant_late_min_m to quant_late_max_m rows it lets the next kernel launch only after its own wait, and
    # from gemm_late_min_m rows (where the attention triggers early again) so do the split-K GEMMs
    quant_late_min_m: int = 3
    quant_late_max_m: int = 16
    gemm_late_min_m: int = 33
    # benchmarks' overrides: the quantization launch's warps (0: the rule above), the SMs the grids plan for
    # (0: the device's), programmatic dependent launch (False: each kernel launches when the one before ends)
    quant_warps: int = 0
    sms: int = 0
    pdl: bool = True
    # ---- the engine's step (runtime/cuda/engine.py) ----
    # steps of up to fused_max_b rows rotate and write the KV cache inside the q|k|v projection (the row GEMV
    # below the gap, the split-K GEMM above it), except from fused_gap[0] to fused_gap[1] rows: the GEMM, then a
    # RoPE launch (fused there measured slower)
    fused_max_b: int = 64
    fused_gap: tuple[int, ...] = (3, 7)
    # up to this batch q|k|v, o and down quantize their input inside their own programs (no quantization launch)
    quant_in_row_max_b: int = 1
    # up to this batch the split-K o and down are left for the next quantization launch to finish (deferred.py)
    defer_max_b: int = 48

    def __post_init__(self):
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _checked(f.name, getattr(self, f.name), f.default))
        if len(self.fused_gap) != 2:
            raise ValueError(f"DecodePlan.fused_gap: expected [first, last], found {list(self.fused_gap)}")

    @classmethod
    def for_gpu(cls, device_name: str) -> DecodePlan:
        """The defaults, then the "plan" section of each step-tune table of this GPU model: the shipped one, then
        the user's over it (`tune.table_files`; a missing table changes nothing)."""
        from bitnetlm.kernels.triton.tune import table_files

        plan = cls()
        for path in reversed(table_files(device_name)):
            plan = plan.with_table(path)
        return plan

    def with_table(self, path: str | Path) -> DecodePlan:
        """This plan overridden by the "plan" section of the step-tune table at `path` (none, or no file: as
        it is); bad JSON, an unknown field or a value of the wrong type is a one-line ValueError naming the file."""
        path = Path(path)
        try:
            table = json.loads(path.read_text())
        except FileNotFoundError:
            return self
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a readable JSON step-tune table ({e})") from None
        if not isinstance(table, dict):
            raise ValueError(
                f"{path}: expected a JSON object (a step-tune table), found {type(table).__name__}"
            )
        section = table.get("plan")
        if section is None:
            return self
        if not isinstance(section, dict):
            raise ValueError(
                f'{path}: "plan" must be an object of DecodePlan fields, found {type(section).__name__}'
            )
        return self.with_values(section, f'{path}: "plan"')

    def with_values(self, values: Mapping[str, object], where: str = "DecodePlan") -> DecodePlan:
        """This plan with `values` (field name -> value; lists for the tuple fields) in place; an unknown name or
        a bad value is a one-line ValueError beginning with `where`."""
        names = {f.name for f in dataclasses.fields(self)}
        for name in values:
            if name not in names:
                raise ValueError(f"{where}: unknown key {name!r} (not a DecodePlan field)")
        try:
            return dataclasses.replace(self, **values)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


def _checked(name: str, value, default):
    """`value` of field `name` as the type of its default (a list becomes a tuple of ints), or a ValueError."""
    if isinstance(default, tuple):
        if isinstance(value, (list, tuple)) and all(type(v) is int for v in value):
            return tuple(value)
        want = "a list of integers"
    elif type(value) is type(default):
        return value
    else:
        want = {bool: "true or false", int: "an integer"}[type(default)]
    raise ValueError(f"DecodePlan.{name}: expected {want}, found {value!r}")


DEFAULT_PLAN = DecodePlan()  # what a launcher given plan=None runs by (immutable: built once, not per launch)


def resolve(plan: DecodePlan | None) -> DecodePlan:
    """`plan`, or the default plan for None."""
    return DEFAULT_PLAN if plan is None else plan


def parse_values(spec: str) -> dict[str, object]:
    """Benchmarks' plan variants: "name=value,name=value" with JSON values ("attn_splits=8,pdl=false,
    attn_pf_table=[2048,1024]") -> {name: value}, for `DecodePlan.with_values`."""
    out: dict[str, object] = {}
    for item in filter(None, re.split(r",(?![^\[]*\])", spec.strip())):  # (no split inside [...])
        name, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"plan variant {item!r}: expected name=value")
        try:
            out[name.strip()] = json.loads(text)
        except ValueError:
            raise ValueError(f"plan variant {item!r}: the value is not JSON (8, true, [1, 2])") from None
    return out
