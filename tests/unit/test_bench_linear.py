"""Packed linears: one copy of each weight, the same numbers as F.linear on every kernel,
a pack check that can fail, no weight expansion for strided inputs, and a compiled graph
that holds no weight constants."""

from __future__ import annotations

import gc
import weakref

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402

from vcfslm.engine import linear  # noqa: E402
from vcfslm.engine.linear import (  # noqa: E402
    DENSE_BF16,
    ONEDNN_FP32,
    ONEDNN_PACKED,
    KernelPlan,
    PackCheckError,
    PackedLinear,
    choose_plan,
    pack_linears,
    packed_kernels,
)

PLANS = [KernelPlan(DENSE_BF16)]
if linear.onednn_available():
    PLANS += [KernelPlan(ONEDNN_FP32)]
if linear.onednn_bf16():
    PLANS += [KernelPlan(ONEDNN_PACKED, 1), KernelPlan(ONEDNN_PACKED, 4)]


def net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(96, 160, bias=True, dtype=torch.bfloat16), torch.nn.SiLU(),
                               torch.nn.Linear(160, 48, bias=False, dtype=torch.bfloat16))


def test_plan_follows_the_cpu():
    assert choose_plan(True) == KernelPlan(ONEDNN_PACKED, linear.DEFAULT_MIN_ROWS)
    assert choose_plan(True, min_rows=1).min_rows == 1
    # Without bf16 in oneDNN (AVX2): fp32 weights in oneDNN's layout; without oneDNN, plain bf16.
    assert choose_plan(False) == KernelPlan(ONEDNN_FP32)
    assert choose_plan(False, has_onednn=False) == KernelPlan(DENSE_BF16)
    assert choose_plan(True, forced=ONEDNN_FP32) == KernelPlan(ONEDNN_FP32)
    assert choose_plan(False, forced=DENSE_BF16) == KernelPlan(DENSE_BF16)
    with pytest.raises(ValueError, match="unknown linear kernel"):
        KernelPlan("fast")


def test_a_forced_plan_is_the_default_and_a_wrong_name_is_refused(monkeypatch):
    monkeypatch.setenv(linear.FORCE_ENV, DENSE_BF16)
    assert linear.default_plan() == KernelPlan(DENSE_BF16)
    monkeypatch.setenv(linear.FORCE_ENV, "avx9")
    with pytest.raises(ValueError, match="VCFSLM_LINEAR_KERNEL='avx9' is not a linear kernel"):
        linear.default_plan()


@pytest.mark.skipif(not linear.onednn_available(), reason="this torch build has no oneDNN")
def test_an_fp32_plan_holds_twice_the_bytes_and_says_so():
    """The records' label says what the plan costs in memory; the pack report's weight bytes
    stay the model's (bf16) bytes, which the roofline counts; the held bytes are twice."""
    plan = KernelPlan(ONEDNN_FP32)
    assert plan.label == "onednn-fp32 (weights held in fp32, 2x the bf16 memory)"
    assert plan.held_bytes_per_weight == 4 and KernelPlan(DENSE_BF16).held_bytes_per_weight == 2
    layer = torch.nn.Linear(96, 160, bias=True, dtype=torch.bfloat16)
    packed = PackedLinear(layer.weight, layer.bias, plan)
    assert packed.weight_nbytes == 96 * 160 * 2
    assert packed.held_nbytes == 96 * 160 * 4 + 160 * 4
    assert packed.model_nbytes == 96 * 160 * 2 + 160 * 2
    x = torch.randn(5, 96).to(torch.bfloat16)
    got = packed(x)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 160)
    want = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    assert (got.float() - want).abs().max().item() <= 2e-2 * want.abs().max().item()


def test_records_name_the_kernel_path():
    """The plan's label and the pack report are what meta.json and the records carry."""
    assert KernelPlan(ONEDNN_PACKED, 4).label == "onednn-packed (rows padded to 4)"
    assert KernelPlan(ONEDNN_PACKED, 1).label == "onednn-packed"
    assert KernelPlan(DENSE_BF16).label == "dense-bf16"
    assert KernelPlan(ONEDNN_PACKED, 4).rows_computed(1) == 4 and KernelPlan(DENSE_BF16).rows_computed(1) == 1
    report = pack_linears(net(), KernelPlan(DENSE_BF16))
    got = report.to_dict()
    assert set(got) == {"kernel", "min_rows", "label", "linears", "weight_bytes", "pack_check_max_rel_error", "shapes"}
    assert (got["kernel"], got["min_rows"], got["label"], got["linears"]) == (DENSE_BF16, 1, "dense-bf16", 2)
    assert got["shapes"] == ["  1 x 0               96 -> 160    dense-bf16", "  1 x 2              160 -> 48     dense-bf16"]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.label)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 70])
def test_packed_linear_matches_f_linear(plan, rows):
    m = net()
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        want = m(x).float()
    pack_linears(m, plan)
    with torch.inference_mode():
        got = m(x).float()
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item()


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.label)
def test_one_copy_originals_are_freed(plan):
    m = net()
    originals = [weakref.ref(layer.weight) for layer in m if isinstance(layer, torch.nn.Linear)]
    weight_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    report = pack_linears(m, plan)
    gc.collect()
    assert all(ref() is None for ref in originals), "an original weight is still alive"
    assert list(m.parameters()) == []
    held = sum(b.numel() * b.element_size() for b in m.buffers())
    # Packed weights + biases: exactly one copy, at the plan's precision (fp32 holds 2x bf16).
    assert held == weight_bytes * plan.held_bytes_per_weight // 2
    assert sum(getattr(layer, "held_nbytes", 0) for layer in m) == weight_bytes * plan.held_bytes_per_weight // 2
    assert sum(getattr(layer, "model_nbytes", 0) for layer in m) == weight_bytes
    assert report.linears == 2 and packed_kernels(m) == {plan.kernel: 2}


def test_pack_check_catches_a_wrong_layout(monkeypatch):
    m = net()
    real = PackedLinear.__init__

    def broken(self, weight, bias, plan):
        real(self, weight.flip(0), bias, plan)  # rows in the wrong order

    monkeypatch.setattr(PackedLinear, "__init__", broken)
    with pytest.raises(PackCheckError, match="differs from F.linear"):
        pack_linears(m, KernelPlan(DENSE_BF16))


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.label)
def test_a_strided_last_position_slice_never_expands_the_weight(plan):
    """HF slices hidden[:, -1:, :] for logits_to_keep=1; at batch > 1 that is strided, and a
    3-D matmul on it goes through bmm with the weight expanded once per stream."""
    head = torch.nn.Linear(64, 4000, bias=False, dtype=torch.bfloat16)
    hidden = torch.randn(8, 5, 64, dtype=torch.bfloat16)
    last = hidden[:, -1:, :]
    assert not last.is_contiguous()
    with torch.no_grad():
        want = F.linear(last.contiguous(), head.weight).float()
    packed = PackedLinear(head.weight, None, plan)
    from torch.profiler import profile

    with torch.inference_mode(), profile() as prof:
        got = packed(last).float()
    names = {e.name for e in prof.events()}
    assert "aten::bmm" not in names and "aten::expand" not in names, names
    assert got.shape == (8, 1, 4000)
    assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item()


def test_compiled_graph_holds_no_weight_constants():
    """No freezing: Inductor's generated module keeps no tensor the size of a weight."""
    from torch._inductor.codecache import PyCodeCache

    m = net(seed=2)
    pack_linears(m, choose_plan(linear.onednn_bf16()))
    x = torch.randn(2, 96, dtype=torch.bfloat16)
    compiled = torch.compile(m, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        eager_out = m(x)
        out = compiled(x)
    assert torch.allclose(out.float(), eager_out.float(), atol=1e-2, rtol=1e-2)
    constants = [v for mod in list(PyCodeCache.modules)
                 for v in vars(mod).values() if isinstance(v, torch.Tensor) and v.numel() >= 96 * 48]
    assert constants == []
