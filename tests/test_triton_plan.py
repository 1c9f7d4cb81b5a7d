"""The CUDA decode step's tuning decisions as data (kernels/triton/plan.py): the default `DecodePlan` is the
measured choice set, a GPU model's step-tune tables override it through their "plan" section, a bad section is a
one-line error naming the file, and the launchers' pure rules follow the plan they are given."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
from triton_interp import triton_modules

A, Q, L, C, P, T = triton_modules("attention", "quant", "launch", "common", "plan", "tune")
PKG = Path(__file__).resolve().parent.parent / "bitnetlm"


def test_default_plan_holds_the_measured_choices():
    plan = P.DecodePlan()
    assert P.resolve(None) is P.DEFAULT_PLAN and P.DEFAULT_PLAN == plan
    assert (plan.attn_programs_per_sm, plan.attn_narrow_programs_per_sm) == (3, 4)
    assert (plan.attn_narrow_min_b, plan.attn_narrow_max_b, plan.attn_late_min_b, plan.attn_late_max_b) == (
        8,
        8,
        8,
        32,
    )
    assert (plan.attn_small_max_b, plan.attn_small_max_keys, plan.attn_small_bs, plan.attn_small_stages) == (
        2,
        1024,
        32,
        2,
    )
    assert (plan.attn_range_max_b, plan.attn_range_bs, plan.attn_range_warps) == (4, 256, 8)
    assert plan.attn_pf_table == (2048, 2048, 1024, 512, 2048, 2048, 2048, 2048)
    assert plan.attn_pf_table_kv16 == (0, 2048, 2048, 1024, 2048, 2048, 2048, 2048)
    assert (plan.attn_pf_block, plan.attn_pf_qkv_max_b, plan.attn_pf_down_batches) == (512, 1, (2,))
    assert (plan.row_max_m, plan.gemv_max_m, plan.splitk_max_m, plan.splitk_prefill_max_m) == (2, 16, 64, 256)
    assert (plan.quant_late_min_m, plan.quant_late_max_m, plan.gemm_late_min_m) == (3, 16, 33)
    assert (plan.early_norm_max_k, plan.row_tiles_min_k, plan.quant_wide_k, plan.quant_narrow_max_m) == (
        8192,
        4096,
        4096,
        16,
    )
    assert (plan.fused_max_b, plan.fused_gap, plan.quant_in_row_max_b, plan.defer_max_b) == (
        64,
        (3, 7),
        1,
        48,
    )
    # the benchmarks' overrides all say "the rule's own choice"
    assert plan.attn_splits == plan.attn_bs == plan.attn_programs == plan.quant_warps == plan.sms == 0
    assert plan.attn_pf_programs == -1 and plan.pdl is True
    # the prefetch programs per batch, as the tables of the former module constants
    assert [A.prefetch_programs(b, True) for b in range(1, 10)] == [2048, 2048, 1024, 512] + [2048] * 4 + [0]
    assert [A.prefetch_programs(b, False) for b in range(1, 10)] == [0, 2048, 2048, 1024] + [2048] * 4 + [0]


def _tables(monkeypatch, tmp_path, shipped, user):
    """Test GPU 9's shipped and user tables (None: no file) in tmp_path; the tuner's settings restored after."""
    monkeypatch.setattr(T, "CONFIG_DIR", tmp_path / "shipped")
    before = T.configure(user_tables=tmp_path / "user")
    for d, table in ((tmp_path / "shipped", shipped), (tmp_path / "user", user)):
        d.mkdir()
        if table is not None:
            (d / "Test_GPU_9.json").write_text(table if isinstance(table, str) else json.dumps(table))
    return before


def test_for_gpu_takes_the_plan_sections_user_over_shipped(monkeypatch, tmp_path):
    tile = {str(("auto", 2560, 2560, 1, False, True, True, True)): {"path": "row", "BN": 8, "num_warps": 4}}
    shipped = {"plan": {"attn_programs_per_sm": 4, "attn_pf_table": [1024, 512], "defer_max_b": 32}, **tile}
    user = {"plan": {"defer_max_b": 16, "pdl": False}}
    before = _tables(monkeypatch, tmp_path, shipped, user)
    try:
        plan = P.DecodePlan.for_gpu("Test GPU 9")
        assert plan == P.DecodePlan(
            attn_programs_per_sm=4, attn_pf_table=(1024, 512), defer_max_b=16, pdl=False
        )
        assert A.prefetch_programs(1, True, plan) == 1024 and A.prefetch_programs(3, True, plan) == 0
        assert P.DecodePlan.for_gpu("Other GPU") == P.DecodePlan()  # no table: the defaults
        T.configure(user_tables=None)  # the shipped table alone
        assert P.DecodePlan.for_gpu("Test GPU 9").defer_max_b == 32
        # the tile entries beside the plan section are read as before
        key = ("auto", 2560, 2560, 1, False, True, True, True)
        assert T.table_choice(key, [{"path": "row", "BN": 8, "num_warps": 4}], "Test GPU 9") is not None
    finally:
        T.configure(**dataclasses.asdict(before))


def test_shipped_tables_keep_the_default_plan():
    """The shipped H200 table has no plan section (yet): its GPU runs the defaults, today's choices."""
    before = T.configure(user_tables=None)
    try:
        assert P.DecodePlan.for_gpu("NVIDIA H200") == P.DecodePlan()
    finally:
        T.configure(**dataclasses.asdict(before))


@pytest.mark.parametrize(
    "table,match",
    [
        ({"plan": {"attn_splitz": 8}}, "unknown key 'attn_splitz' \\(not a DecodePlan field\\)"),
        ({"plan": {"attn_splits": "8"}}, "DecodePlan.attn_splits: expected an integer, found '8'"),
        ({"plan": {"defer_max_b": True}}, "DecodePlan.defer_max_b: expected an integer, found True"),
        ({"plan": {"pdl": 0}}, "DecodePlan.pdl: expected true or false, found 0"),
        ({"plan": {"fused_gap": [3]}}, "DecodePlan.fused_gap: expected \\[first, last\\], found \\[3\\]"),
        ({"plan": {"attn_pf_table": [2048, 1.5]}}, "DecodePlan.attn_pf_table: expected a list of integers"),
        ({"plan": [1, 2]}, '"plan" must be an object of DecodePlan fields, found list'),
        ("{not json", "not a readable JSON step-tune table"),
        ("[1, 2]", "expected a JSON object \\(a step-tune table\\), found list"),
    ],
)
def test_a_bad_plan_section_is_a_one_line_error_naming_the_file(monkeypatch, tmp_path, table, match):
    before = _tables(monkeypatch, tmp_path, None, table)
    try:
        with pytest.raises(ValueError, match=match) as e:
            P.DecodePlan.for_gpu("Test GPU 9")
    finally:
        T.configure(**dataclasses.asdict(before))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(tmp_path / "user" / "Test_GPU_9.json"))


def test_benchmark_variants_parse_into_plan_values():
    values = P.parse_values("attn_splits=8, pdl=false,attn_pf_table=[2048, 1024],fused_gap=[4,6]")
    assert values == {"attn_splits": 8, "pdl": False, "attn_pf_table": [2048, 1024], "fused_gap": [4, 6]}
    plan = P.DecodePlan().with_values(values, "--variants")
    assert (plan.attn_splits, plan.pdl, plan.attn_pf_table, plan.fused_gap) == (
        8,
        False,
        (2048, 1024),
        (4, 6),
    )
    assert P.parse_values("") == {}
    with pytest.raises(ValueError, match="--variants: unknown key 'splits'"):
        P.DecodePlan().with_values(P.parse_values("splits=8"), "--variants")
    with pytest.raises(ValueError, match="expected name=value"):
        P.parse_values("attn_splits")
    with pytest.raises(ValueError, match="not JSON"):
        P.parse_values("attn_splits=eight")


def test_attention_launch_follows_the_plan():
    """The attention's pure rules (compiled-kernel choices, `interpret=False`): splits from the programs per SM
    (2B4T's 5 KV heads, an H200's 132 SMs, 700 cache slots), 2 warps and 4 programs an SM over a float8 cache at
    batch 8, small blocks within 1,024 keys, one range block within 256 keys; each changes with its field."""
    base = dict(hkv=5, s=700, d=128, itemsize=2, sms=132, interpret=False)

    def launch(b, kv8, keys, plan=None):
        return A.attn_launch(b, kv8=kv8, keys=keys, plan=plan, **base)

    assert launch(1, True, 0) == (32, 64, 4, 0, 0)  # 3 x 132 // 5 programs a row, at most 32
    assert launch(1, True, 0, P.DecodePlan(attn_programs_per_sm=1)) == (26, 64, 4, 0, 0)
    assert launch(8, True, 0) == (13, 64, 2, 0, 0) and launch(8, False, 0) == (9, 64, 2, 0, 0)
    assert launch(8, True, 0, P.DecodePlan(attn_narrow_max_b=7)) == (9, 64, 4, 0, 0)
    assert launch(1, True, 1024) == (32, 32, 4, 2, 0)
    assert launch(1, True, 1024, P.DecodePlan(attn_small_bs=16, attn_small_stages=3)) == (32, 16, 4, 3, 0)
    assert launch(4, True, 256) == (1, 256, 8, 1, 0)
    assert launch(4, True, 256, P.DecodePlan(attn_range_warps=4)) == (1, 256, 4, 1, 0)
    over = P.DecodePlan(attn_splits=8, attn_bs=32, attn_stages=3, attn_warps=8, attn_maxnreg=128)
    assert launch(1, True, 0, over) == (8, 32, 8, 3, 128)
    # the key range a step is captured for, and where the attention triggers the next launch
    assert A.key_range(2, 500) == 1024 and A.key_range(2, 500, P.DecodePlan(attn_small_max_b=1)) == 0
    assert A.late_launch(8) and not A.late_launch(8, P.DecodePlan(attn_late_min_b=9))
    assert A.prefetch_candidates(1, True, P.DecodePlan(attn_pf_counts=(0, 4096)))[1:] == [
        {"programs": 0},
        {"programs": 4096},
    ]


def test_projection_rules_follow_the_plan():
    """The projections' path order by rows, the quantization launch's trigger and warps, PDL."""
    assert L.linear_candidates(2, 24, 100, False)[0]["path"] == "row"
    assert L.linear_candidates(2, 24, 100, False, plan=P.DecodePlan(row_max_m=1))[0]["path"] == "splitk"
    assert Q.quant_launch_kw(4, 2560, False)["LATE"] is True
    assert Q.quant_launch_kw(4, 2560, False, P.DecodePlan(quant_late_min_m=5))["LATE"] is False
    assert Q.quant_launch_kw(4, 2560, True, P.DecodePlan(quant_late_min_m=5))["LATE"] is True
    assert C.pdl_kw(P.DecodePlan(pdl=False)) == {}
    assert Q._quant_warps(4, 2560, P.DecodePlan()) in (1, 8)  # (1 under the interpreter)
    assert Q._quant_warps(4, 2560, P.DecodePlan(quant_warps=4)) in (1, 4)


def test_engine_config_carries_the_plan():
    import torch
    from oracle import tiny_config_kwargs

    from bitnetlm.models import ModelConfig
    from bitnetlm.runtime.cuda.engine import CudaEngine, EngineConfig

    cfg = ModelConfig(arch="bitnet", rope_theta=10000.0, **tiny_config_kwargs("packed-autobitlinear"))
    plan = P.DecodePlan(defer_max_b=4)
    ecfg = EngineConfig(max_batch=1, max_seq_len=8, dtype=torch.float32, plan=plan)
    assert CudaEngine.random(cfg, ecfg, device="cpu").plan is plan
    ecfg = EngineConfig(max_batch=1, max_seq_len=8, dtype=torch.float32)
    assert CudaEngine.random(cfg, ecfg, device="cpu").plan == P.DecodePlan()  # off CUDA: the defaults


def _imports(path: Path) -> set[str]:
    """The bitnetlm.kernels.triton modules `path` imports, at module level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "bitnetlm.kernels.triton":
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bitnetlm.kernels.triton."):
            out.add(node.module.rsplit(".", 1)[1])
    return out


def test_kernel_modules_import_no_circle():
    """kernels/triton's modules import one another one way (deferred.py and launch.py were a circle)."""
    mods = {p.stem: _imports(p) for p in (PKG / "kernels" / "triton").glob("*.py") if p.stem != "__init__"}
    assert "launch" not in mods["deferred"]
    done: set[str] = set()

    def visit(m: str, path: tuple[str, ...]) -> None:
        assert m not in path, f"import circle: {' -> '.join((*path, m))}"
        if m in done or m not in mods:
            return
        for n in mods[m]:
            visit(n, (*path, m))
        done.add(m)

    for m in mods:
        visit(m, ())


def test_decode_step_reads_no_experiment_switch_from_the_environment():
    """The kernels and the CUDA engine read no BITNETLM_* variable (their switches are DecodePlan fields or
    `tune.configure` settings); the tuner's files follow BITNET_CACHE."""
    files = [*(PKG / "kernels" / "triton").glob("*.py"), *(PKG / "runtime" / "cuda").glob("*.py")]
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert not node.value.startswith("BITNETLM_"), f"{f.name} reads {node.value}"
