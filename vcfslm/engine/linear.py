"""One copy of every weight, in the layout the CPU's fastest bf16 kernel reads, for prefill
and decode alike.

`pack_linears(model)` swaps each `nn.Linear` of a model for a `PackedLinear` that holds
only its weight in that layout, dropping the original as it goes (the peak stays near one
copy of the weights). Both phases then call one opaque op, `vcfslm::linear`; under
`torch.compile` it is an extern call Inductor cannot see into, so it fuses what lies
between the linears (norms,
rotary, activations, the cache update) while the matrix products stay on the chosen kernel,
and the graph holds no frozen constants (no second copy; the FX graph cache works).

The kernel plan, chosen once per process from what the CPU offers; both are stock PyTorch
ops, no code of vcfslm's own in the matrix products:

- `onednn-packed` (oneDNN has bf16: AVX512-BF16 or AMX): the weight is reordered once
  into oneDNN's blocked layout (`mkldnn._reorder_linear_weight`) and every call runs
  `mkldnn._linear_pointwise` on it: the AMX/AVX512-BF16 GEMM for prefill, and for decode
  a GEMV that reads the packed layout faster than the plain one (measured on an AMX
  Xeon: 32.8 vs 22.7 GB/s). Rows fewer than `min_rows` are padded up to it: oneDNN's
  one-row path is slower than its few-row one, and extra rows add no weight reads.
- `onednn-fp32` (oneDNN without bf16, e.g. AVX2 only): the weight is converted to fp32 once
  and reordered into oneDNN's blocked layout; every call casts its rows to fp32, runs
  oneDNN's fp32 GEMM on the packed weight and casts the result back to bf16. The replica
  holds its linears in fp32: twice the memory of bf16 and twice the bytes per decode step,
  but fp32 is what these CPUs multiply natively. Measured on a 2-core AVX2 EPYC (family 25
  model 1, Phi-3-mini's linears at 4 layers, `benchmarks/decode_efficiency.py`): one row
  read the fp32 weights at ~0.7-0.9 of the plain read bandwidth and four rows cost ~1.3-1.5x
  one, where dense-bf16's per-row bf16 GEMV read the bf16 weights at a fifth of it and
  four rows cost four times one (four streams, four weight reads).
- `dense-bf16` (no oneDNN at all, or forced): the weight stays a plain bf16
  matrix. Few rows (decode at small batch) go through ATen's bf16 GEMV (`torch.mv`) one
  row at a time. More rows (prefill, big batches) convert the weight to fp32 one
  cache-sized slice at a time into a reused scratch buffer and run SGEMM on it, several
  times faster than a bf16 GEMM without hardware bf16.

`VCFSLM_LINEAR_KERNEL=<kernel>` in a rank's environment forces a plan (to measure one plan
on a CPU that would pick another); records name the plan that ran either way.

A weight is checked when it is packed: the packed kernel's output on a few random rows
must match `F.linear` on the original weight, or packing fails loudly. This catches a
wrong layout before any window is measured.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch

ONEDNN_PACKED = "onednn-packed"
ONEDNN_FP32 = "onednn-fp32"
DENSE_BF16 = "dense-bf16"
KERNELS = (ONEDNN_PACKED, ONEDNN_FP32, DENSE_BF16)
# The environment variable that forces a plan (one of KERNELS).
FORCE_ENV = "VCFSLM_LINEAR_KERNEL"

# onednn-fp32: the row count oneDNN's weight layout is reordered for. Measured on the AVX2
# EPYC above (Phi-3-mini's linears, fp32 weights, 2 threads): reordered for 1 row, one row
# read at ~50 ms but four took ~2.5x that; reordered for 2 to 8 rows, one row took ~60-70
# ms and four ~1.3x one. Decode batches of a few streams are what serving runs.
FP32_PACK_ROWS = 4

# dense-bf16: at most this many rows run as one GEMV each (each streams the weight once);
# more rows convert the weight to fp32 a slice at a time and run SGEMM on the slice. A slice
# of ~6 MB stays in the last-level cache, so memory sees the bf16 weight read once, not a
# 4-byte copy written and read back (measured on AVX2 code paths, 16 rows: 6.7 GB/s of
# weights against 2.5 for one whole-matrix conversion).
DENSE_GEMV_MAX_ROWS = 4
DENSE_CHUNK_ELEMENTS = 512 * 3072


@dataclass(frozen=True)
class KernelPlan:
    """How every linear of a replica runs. min_rows: onednn-packed pads fewer rows to this."""

    kernel: str
    min_rows: int = 1

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"unknown linear kernel {self.kernel!r}; known: {', '.join(KERNELS)}")
        if self.min_rows < 1:
            raise ValueError("min_rows must be >= 1")

    @property
    def label(self) -> str:
        """The kernel path, as records and meta.json name it."""
        notes = [f"rows padded to {self.min_rows}"] if self.min_rows > 1 else []
        if self.held_bytes_per_weight != 2:
            notes.append(f"weights held in fp32, {self.held_bytes_per_weight // 2}x the bf16 memory")
        return self.kernel + (f" ({'; '.join(notes)})" if notes else "")

    @property
    def held_bytes_per_weight(self) -> int:
        """Bytes the plan holds (and a decode step reads) per weight: 4 in fp32, else bf16's 2."""
        return 4 if self.kernel == ONEDNN_FP32 else 2

    def rows_computed(self, rows: int) -> int:
        """The rows a call of `rows` rows computes: padded up to min_rows (pure)."""
        return max(rows, self.min_rows)


def onednn_bf16() -> bool:
    """Whether oneDNN has a native bf16 GEMM on this CPU (AVX512-BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # pragma: no cover - builds without oneDNN
        return False


def onednn_available() -> bool:
    """Whether this torch build has oneDNN (mkldnn) at all."""
    return bool(torch.backends.mkldnn.is_available())


def choose_plan(has_onednn_bf16: bool, *, min_rows: int | None = None, has_onednn: bool = True,
                forced: str | None = None) -> KernelPlan:
    """The kernel plan for a CPU (pure). min_rows: override the one-row padding (onednn-packed).
    forced: a kernel name that overrides the choice (VCFSLM_LINEAR_KERNEL)."""
    kernel = forced or (ONEDNN_PACKED if has_onednn_bf16 else ONEDNN_FP32 if has_onednn else DENSE_BF16)
    if kernel == ONEDNN_PACKED:
        return KernelPlan(ONEDNN_PACKED, DEFAULT_MIN_ROWS if min_rows is None else min_rows)
    return KernelPlan(kernel)


def default_plan() -> KernelPlan:
    """The plan for this process's CPU: the best stock kernel it offers, unless
    VCFSLM_LINEAR_KERNEL forces one."""
    forced = os.environ.get(FORCE_ENV) or None
    if forced is not None and forced not in KERNELS:
        raise ValueError(f"{FORCE_ENV}={forced!r} is not a linear kernel; known: {', '.join(KERNELS)}")
    return choose_plan(onednn_bf16(), has_onednn=onednn_available(), forced=forced)


# oneDNN's M=1 bf16 path reads the packed weight slower than its M=4 path on the CPUs
# measured (benchmarks/decode_efficiency.py prints both); 4 rows cost the same reads.
DEFAULT_MIN_ROWS = 4


# ------------------------------------------------------------------ the op

_scratch: dict[str, torch.Tensor] = {}


def _fp32_scratch(numel: int) -> torch.Tensor:
    """One fp32 buffer reused by every wide dense-bf16 call (one slice's size)."""
    buf = _scratch.get("w")
    if buf is None or buf.numel() < numel:
        # A normal tensor, even when first asked for under inference_mode: an inference
        # tensor could not be written outside it (pack checks run outside).
        with torch.inference_mode(False):
            buf = torch.empty(numel, dtype=torch.float32)
        _scratch["w"] = buf
    return buf[:numel]


def run_kernel(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int,
               kernel: str, min_rows: int) -> torch.Tensor:
    """y = x2 @ weight.T + bias [rows, out_features] for a contiguous 2-D x2, on the planned
    kernel: the one call every packed linear reaches, eager or from a compiled graph
    (vcfslm::linear). Looked up on this module at each call, so a benchmark may wrap it to
    time or skip the matrix products (benchmarks/decode_efficiency.py does)."""
    rows = x2.shape[0]
    if kernel == ONEDNN_PACKED:
        if rows < min_rows:
            padded = x2.new_zeros(min_rows, x2.shape[1])
            padded[:rows] = x2
            return torch.ops.mkldnn._linear_pointwise(padded, weight, bias, "none", [], "")[:rows]
        return torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")
    if kernel == ONEDNN_FP32:
        return torch.ops.mkldnn._linear_pointwise(x2.float(), weight, bias, "none", [], "").to(x2.dtype)
    if rows <= DENSE_GEMV_MAX_ROWS:
        out = torch.empty(rows, weight.shape[0], dtype=x2.dtype)
        for i in range(rows):
            torch.mv(weight, x2[i], out=out[i])
        return out if bias is None else out + bias
    n, k = weight.shape
    step = min(n, max(1, DENSE_CHUNK_ELEMENTS // k))
    out = _fp32_product_t(x2, weight, _fp32_scratch(step * k).view(step, k)).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x2.dtype).contiguous()


def _fp32_product_t(x2: torch.Tensor, weight: torch.Tensor, slice32: torch.Tensor) -> torch.Tensor:
    """(x2 @ weight.T).T in fp32, [out, rows]: a slice of weight rows at a time, each converted
    into `slice32` ([slice rows, k], reused) and multiplied into one preallocated output. The
    weight is never converted whole, and nothing is allocated per slice: a fresh fp32 slice
    per step, each followed by its small output, left the heap a row of holes a few bytes too
    small for the next slice (measured: ~360 MB resident after the lm_head's pack check).
    Transposed, so each slice writes contiguous output rows (a column slice of [rows, out]
    would be strided: ~2x slower at decode-sized rows)."""
    n = weight.shape[0]
    x32t = x2.float().t()
    out_t = torch.empty(n, x2.shape[0], dtype=torch.float32)
    step = slice32.shape[0]
    for start in range(0, n, step):
        stop = min(n, start + step)
        rows = slice32[:stop - start]
        rows.copy_(weight[start:stop])
        torch.mm(rows, x32t, out=out_t[start:stop])
    return out_t


def linear_eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                 kernel: str, min_rows: int) -> torch.Tensor:
    """x [..., in] -> [..., out_features] through a weight held by `kernel`'s layout."""
    lead = x.shape[:-1]
    # A contiguous 2-D input: a strided one (HF's last-position slice for batch > 1) would
    # send a 3-D matmul through bmm, which expands the weight once per stream.
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    return run_kernel(x2, weight, bias, out_features, kernel, min_rows).view(*lead, out_features)


# The op a compiled graph calls: opaque to Inductor, which fuses what lies between the
# linears. Defined on a torch.library.Library with one CompositeExplicitAutograd kernel
# rather than through torch.library.custom_op: custom_op's Python autograd and dispatch
# wrappers ran on every call, and with a decode step's 129 calls each starting with cold
# caches behind a weight stream, that read the weights ~6% slower than the same kernel
# called through a plain registration.
_OPS = torch.library.Library("vcfslm", "FRAGMENT")
_OPS.define("linear(Tensor x, Tensor weight, Tensor? bias, int out_features, str kernel, int min_rows) -> Tensor")
_OPS.impl("linear", linear_eager, "CompositeExplicitAutograd")


@torch.library.register_fake("vcfslm::linear", lib=_OPS)
def _linear_fake(x, weight, bias, out_features, kernel, min_rows):
    return x.new_empty(*x.shape[:-1], out_features)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int,
           kernel: str, min_rows: int) -> torch.Tensor:
    """The op under torch.compile (an extern call in Inductor's graph); eager, its kernel
    called directly (no dispatcher)."""
    if torch.compiler.is_compiling():
        return torch.ops.vcfslm.linear.default(x, weight, bias, out_features, kernel, min_rows)
    return linear_eager(x, weight, bias, out_features, kernel, min_rows)


# ------------------------------------------------------------------ modules


class PackedLinear(torch.nn.Module):
    """A linear layer that holds one copy of its weight, in its kernel's layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, plan: KernelPlan):
        super().__init__()
        self.in_features = int(weight.shape[1])
        self.out_features = int(weight.shape[0])
        self.kernel = plan.kernel
        self.min_rows = plan.min_rows
        # The model's bytes for this weight (bf16): what the roofline and the probes count.
        self.weight_nbytes = weight.numel() * weight.element_size()
        if plan.kernel == ONEDNN_PACKED:
            stored = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), plan.min_rows)
        elif plan.kernel == ONEDNN_FP32:
            stored = torch.ops.mkldnn._reorder_linear_weight(weight.detach().float(), FP32_PACK_ROWS)
        else:
            stored = weight.detach().contiguous()
        held_bias = None if bias is None else bias.detach().clone()
        if held_bias is not None and plan.kernel == ONEDNN_FP32:
            held_bias = held_bias.float()
        # Buffers, not parameters: nothing may treat them as trainable or re-materialise them.
        self.register_buffer("packed_weight", stored)
        self.register_buffer("bias", held_bias)
        # Bytes held, logically (an oneDNN-packed tensor has no storage to measure): fp32
        # plans hold twice the model's bytes.
        self.held_nbytes = (weight.numel() * plan.held_bytes_per_weight
                            + (0 if held_bias is None else held_bias.numel() * held_bias.element_size()))
        # The same at the model's precision: the weight's and the bias's own bytes.
        self.model_nbytes = self.weight_nbytes + (0 if bias is None else bias.numel() * bias.element_size())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.packed_weight, self.bias, self.out_features, self.kernel, self.min_rows)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kernel={self.kernel}, min_rows={self.min_rows}"


@dataclass(frozen=True)
class PackReport:
    """What pack_linears did: how many linears, their weight bytes, the worst check error."""

    plan: KernelPlan
    linears: int
    weight_bytes: int
    max_rel_error: float
    shapes: tuple[str, ...] = ()   # kernel_table of the packed model

    def to_dict(self) -> dict:
        return {"kernel": self.plan.kernel, "min_rows": self.plan.min_rows, "label": self.plan.label,
                "linears": self.linears, "weight_bytes": self.weight_bytes,
                "pack_check_max_rel_error": self.max_rel_error, "shapes": list(self.shapes)}


class PackCheckError(RuntimeError):
    """A packed weight does not reproduce F.linear on its original weight."""


# Packing must not change what a linear computes beyond bf16 output rounding (2^-8
# relative) plus a different accumulation order.
PACK_CHECK_RTOL = 2e-2
# 3 and 7 rows: the few-row paths (oneDNN's GEMV, 3 rows padded to min_rows; dense-bf16's
# per-row torch.mv at 3, its fp32 slices at 7); 33: the many-row one (prefill's, either plan).
_CHECK_ROWS = (3, 7, 33)
_CHECK_SLICE = 1024


@torch.no_grad()
def pack_linears(model: torch.nn.Module, plan: KernelPlan, *, check: bool = True,
                 seed: int = 0) -> PackReport:
    """Replace every nn.Linear of `model` by a PackedLinear, one at a time, dropping each
    original weight before the next is packed (so the peak stays near one copy)."""
    gen = torch.Generator().manual_seed(seed)
    names = [name for name, m in model.named_modules() if type(m) is torch.nn.Linear]
    total, worst = 0, 0.0
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        original = getattr(parent, child)
        packed = PackedLinear(original.weight, original.bias, plan)
        if check:
            worst = max(worst, _check(original, packed, gen))
        total += packed.weight_nbytes
        setattr(parent, child, packed)
        del original
    gc.collect()
    return PackReport(plan, len(names), total, worst, tuple(kernel_table(model)))


@torch.no_grad()
def _check(original: torch.nn.Linear, packed: PackedLinear, gen: torch.Generator) -> float:
    """Relative max error of the packed kernel against F.linear on a few random rows, on
    both the few-row and the many-row path."""
    w = original.weight
    worst = 0.0
    for count in _CHECK_ROWS:
        x = torch.randn(count, w.shape[1], generator=gen).to(w.dtype)
        # The fp32 reference through a slice buffer of its own, freed after the check.
        want = _fp32_product_t(x, w, torch.empty(min(w.shape[0], _CHECK_SLICE), w.shape[1])).t()
        if original.bias is not None:
            want += original.bias.float()
        got = packed(x).float()
        # In place, no temporaries: at 33 rows the lm_head's fp32 outputs are MBs each, and a
        # checkpoint load's peak is measured.
        scale = max(want.max().item(), -want.min().item()) or 1.0
        err = got.sub_(want).abs_().max().item() / scale
        if not err <= PACK_CHECK_RTOL:  # also catches NaN
            raise PackCheckError(f"packed {packed.kernel} weight {tuple(w.shape)} differs from F.linear "
                                 f"at {count} rows: max relative error {err:.3g} > {PACK_CHECK_RTOL}")
        worst = max(worst, err)
    return worst


def kernel_table(model: torch.nn.Module) -> list[str]:
    """One line per distinct (linear name, in -> out, kernel), with how many there are: what
    each shape of the model runs on (every family names its linears differently: Phi-3's
    fused qkv_proj, Llama's q/k/v_proj, ...)."""
    groups: dict[tuple[str, int, int, str], int] = {}
    for name, m in model.named_modules():
        if isinstance(m, PackedLinear):
            key = (name.rsplit(".", 1)[-1], m.in_features, m.out_features, m.kernel)
        elif isinstance(m, torch.nn.Linear):
            key = (name.rsplit(".", 1)[-1], m.in_features, m.out_features, "torch.nn.Linear (unpacked)")
        else:
            continue
        groups[key] = groups.get(key, 0) + 1
    return [f"{n:>3} x {short:<12} {i:>5} -> {o:<6} {kernel}" for (short, i, o, kernel), n in groups.items()]


def packed_kernels(model: torch.nn.Module) -> dict[str, int]:
    """How many linears of `model` run on each kernel ('torch.nn.Linear' for unpacked ones)."""
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, PackedLinear):
            key = m.kernel
        elif isinstance(m, torch.nn.Linear):
            key = "torch.nn.Linear"
        else:
            continue
        counts[key] = counts.get(key, 0) + 1
    return counts
