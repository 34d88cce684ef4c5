"""Load a safetensors checkpoint into a model skeleton at about one copy of its weights.

`from_pretrained` followed by packing holds the checkpoint and the packed model at once
(measured on an AMX Xeon: 2.1x the weights at its peak). Here the tensors are taken one
by one instead:

1. The model is built with every parameter on the meta device and every buffer real
   (`parameters_on_meta`): non-persistent buffers (rotary inv_freq, Gemma's embed_scale)
   are computed by the modules' own constructors, exactly as a fresh model has them.
2. Each checkpoint file is memory-mapped, and every tensor becomes a view of its bytes:
   no copy, no page read yet. A tensor stored in another dtype is converted to the
   model's dtype now (that one is a copy). Tied parameters (lm_head on embed_tokens) get
   one tensor for all their names, so a tie stays a tie.
3. `before_pack(model)` runs once on the whole model, mapped and not yet packed (a
   reference forward pass reads the mapped pages; nothing is copied for it).
4. Tensor by tensor, largest first: each nn.Linear is packed as soon as its weight (and
   bias) are there (`linear.pack_linears`, pack check included), every other tensor is
   copied into memory of its own (a slice at a time), and the source pages are given back
   with madvise(MADV_DONTNEED). File-backed pages of a mapping count in RSS while mapped;
   once given back they are only page cache, which is no process's memory. The peak is
   then the weights settled so far plus the tensor at hand held twice (source and result),
   never the checkpoint and the packed model together; largest first puts the biggest
   double holdings where the least is settled. After `before_pack` every page is given
   back first (its forward pass read them all); packing reads them again from the cache.

Without a plan, step 4 copies every tensor into memory of its own (the engine packs later,
one linear at a time, dropping each original as it goes): the peak is again one copy.

A model packed here carries its PackReport (`packed_report`): the engine keeps it and packs
nothing again.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import mmap
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoint_files import CheckpointError, TensorEntry, checkpoint_entries
from .linear import DENSE_BF16, KernelPlan, PackReport, kernel_table, pack_linears

PACK_REPORT_ATTR = "vcfslm_pack_report"
TORCH_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
                "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
                "F64": torch.float64}
PAGE = mmap.PAGESIZE
# A tensor is copied out of its mapping this much at a time (see _MappedFile.copy).
COPY_SLICE_BYTES = 16 << 20


def mark_packed(model: torch.nn.Module, report: PackReport) -> None:
    """Record that `model`'s linears are packed, and how."""
    object.__setattr__(model, PACK_REPORT_ATTR, report)


def packed_report(model: torch.nn.Module) -> PackReport | None:
    """The PackReport of a model packed by its loader, None for a model still to pack."""
    return model.__dict__.get(PACK_REPORT_ATTR)


@contextmanager
def parameters_on_meta():
    """Modules built inside get every parameter on the meta device (no memory, no init) and
    every buffer real: a constructor's own buffers are then right without a rebuild."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        held = module._parameters.get(name)
        if held is not None and not held.is_meta:
            module._parameters[name] = torch.nn.Parameter(held.to("meta"), requires_grad=held.requires_grad)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


class _MappedFile:
    """One safetensors file mapped read-only; tensors are views of it."""

    def __init__(self, path: Path):
        with open(path, "rb") as fh:
            self.map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)

    def view(self, entry: TensorEntry) -> torch.Tensor:
        dtype = TORCH_DTYPES.get(entry.dtype)
        if dtype is None:
            raise CheckpointError(f"{entry.path}: tensor {entry.name}: dtype {entry.dtype} cannot be loaded")
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=dtype)
        with warnings.catch_warnings():
            # The mapping is read-only; nothing writes a weight (a write would fault loudly).
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self.map, dtype=dtype, count=entry.nbytes // dtype.itemsize, offset=entry.start)
        return flat.view(entry.shape)

    def copy(self, entry: TensorEntry, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (a view of `entry`) in memory of its own, a slice at a time, each slice's
        pages given back once copied: the copy never holds more than one slice twice."""
        flat_in = tensor.reshape(-1)
        out = torch.empty_like(flat_in)
        step = max(1, COPY_SLICE_BYTES // max(1, flat_in.element_size()))
        for begin in range(0, flat_in.numel(), step):
            out[begin:begin + step].copy_(flat_in[begin:begin + step])
            self._advise(entry.start + begin * flat_in.element_size(),
                         min(step, flat_in.numel() - begin) * flat_in.element_size(), inward=True)
        self.release(entry)
        return out.view(tensor.shape)

    def release(self, entry: TensorEntry) -> None:
        """Give back the pages of `entry` (whole pages around it: a page it shares with a
        neighbour is clean and file-backed, so a later read of the neighbour refaults it)."""
        self._advise(entry.start, entry.nbytes, inward=False)

    def release_all(self) -> None:
        self._advise(0, len(self.map), inward=False)

    def _advise(self, start: int, nbytes: int, *, inward: bool) -> None:
        # madvise takes whole pages. Inward: only the pages inside the range (a slice's
        # neighbour is still to be copied); outward: the pages it touches.
        end = start + nbytes
        lo = -(-start // PAGE) * PAGE if inward else start // PAGE * PAGE
        hi = end // PAGE * PAGE if inward else min(len(self.map), -(-end // PAGE) * PAGE)
        if hi > lo:
            self.map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


@dataclass
class _Group:
    """One tensor of the model and every name it goes by (several for tied weights)."""

    names: list[str]
    like: torch.Tensor
    is_param: bool
    entry: TensorEntry | None = None
    mapped: bool = False
    linears: list[str] = field(default_factory=list)   # linears whose weight or bias it is
    elsewhere: bool = False                            # also used outside those linears


def load_weights(model: torch.nn.Module, folder: Path, *, plan: KernelPlan | None = None,
                 before_pack: Callable[[torch.nn.Module], None] | None = None,
                 check: bool = True) -> PackReport | None:
    """Fill a `parameters_on_meta` skeleton from the checkpoint in `folder` (see the module
    docstring); with a plan, pack every nn.Linear as it arrives. The PackReport, or None
    without a plan. Raises CheckpointError naming the folder and the tensor when the file and
    the model disagree (a name only one of them has, a shape)."""
    folder = Path(folder)
    groups = _groups(model)
    by_name = {name: g for g in groups for name in g.names}
    entries = checkpoint_entries(folder)
    arch = type(model).__name__
    for entry in entries:
        group = by_name.get(entry.name)
        if group is None:
            raise CheckpointError(f"{folder}: tensor {entry.name} ({entry.path.name}) is not a weight of {arch}")
        if entry.shape != tuple(group.like.shape):
            raise CheckpointError(f"{folder}: tensor {entry.name} has shape {list(entry.shape)}; "
                                  f"{arch} expects {list(group.like.shape)}")
        group.entry = group.entry or entry  # a tie saved under both names: the first copy serves
    absent = [g.names[0] for g in groups if g.entry is None]
    if absent:
        more = f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""
        raise CheckpointError(f"{folder}: tensor {absent[0]} of {arch} is missing from the checkpoint{more}")

    files = {path: _MappedFile(path) for path in dict.fromkeys(e.path for e in entries)}
    for group in groups:
        _map(group, files, model)
    linears = _linears(model, by_name)
    # The skeleton's objects are long-lived: keep them out of the collections pack_linears runs.
    gc.freeze()
    try:
        if before_pack is not None:
            before_pack(model)
            # Its forward pass read every mapped page: give them back before packing starts,
            # or the peak would be the checkpoint plus the packed model after all (a page
            # packed later is read again from the page cache).
            for mapped in files.values():
                mapped.release_all()
        report = _settle(model, groups, linears, files, plan, check)
    finally:
        gc.unfreeze()
    _no_meta_left(model, folder)
    if report is not None:
        mark_packed(model, report)
    return report


def _groups(model: torch.nn.Module) -> list[_Group]:
    """The model's persistent tensors, tied names together, in state_dict order."""
    params = {id(p) for p in model.parameters()}
    groups: dict[int, _Group] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if not isinstance(tensor, torch.Tensor):
            continue
        group = groups.get(id(tensor))
        if group is None:
            groups[id(tensor)] = _Group([name], tensor, id(tensor) in params)
        else:
            group.names.append(name)
    return list(groups.values())


def _linears(model: torch.nn.Module, by_name: dict[str, _Group]) -> dict[str, list[_Group]]:
    """Every plain nn.Linear (what pack_linears packs) -> the groups of its weight and bias."""
    out: dict[str, list[_Group]] = {}
    for name, module in model.named_modules():
        if type(module) is not torch.nn.Linear:
            continue
        prefix = f"{name}." if name else ""
        parts = [by_name[prefix + attr] for attr in ("weight", "bias") if getattr(module, attr) is not None]
        out[name] = parts
        for part in parts:
            part.linears.append(name)
    linear_names = {f"{n}.{a}" if n else a for n in out for a in ("weight", "bias")}
    for group in by_name.values():
        group.elsewhere = any(name not in linear_names for name in group.names)
    return out


def _assign(model: torch.nn.Module, group: _Group, tensor: torch.Tensor) -> None:
    """Put `tensor` under every name of `group` (one Parameter for all: ties stay ties)."""
    value = torch.nn.Parameter(tensor, requires_grad=False) if group.is_param else tensor
    for name in group.names:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        (owner._parameters if group.is_param else owner._buffers)[attr] = value


def _map(group: _Group, files: dict[Path, _MappedFile], model: torch.nn.Module) -> None:
    """The group's tensor as a view of its file, converted (a copy) when its dtype differs."""
    entry = group.entry
    tensor = files[entry.path].view(entry)
    want = group.like.dtype
    group.mapped = tensor.dtype == want
    if not group.mapped:
        if not (tensor.is_floating_point() and want.is_floating_point):
            raise CheckpointError(f"{entry.path.parent}: tensor {entry.name} is {entry.dtype}; the model holds {want}")
        tensor = tensor.to(want)
        files[entry.path].release(entry)
    _assign(model, group, tensor)


def _settle(model, groups, linears, files, plan, check) -> PackReport | None:
    """Pack or copy every tensor, largest first, giving its pages back as it goes."""
    waiting = {name: {id(g) for g in parts} for name, parts in linears.items()}
    packed: list[PackReport] = []
    # Largest first: while a tensor is copied or packed it is held twice (its source and its
    # result), and the first ones are held twice on top of the least settled memory.
    order = sorted(groups, key=lambda g: (-g.entry.nbytes, str(g.entry.path), g.entry.start))
    # dense-bf16 keeps a weight as it is: the weight is copied (a slice at a time) and packed
    # from the copy; other layouts are packed straight from the mapped view.
    copy_first = plan is None or plan.kernel == DENSE_BF16
    for group in order:
        if copy_first or group.elsewhere or not group.linears:
            if group.mapped:  # a tensor of its own, its pages given back as it is copied
                _assign(model, group, files[group.entry.path].copy(group.entry, _current(model, group)))
                group.mapped = False
        if plan is None:
            continue
        for name in group.linears:
            waiting[name].discard(id(group))
            if not waiting[name]:
                packed.append(_pack_one(model, name, linears[name], plan, check))
                _trim_heap()
                for part in linears[name]:
                    if part.mapped and all(not waiting[n] for n in part.linears):
                        files[part.entry.path].release(part.entry)
                        part.mapped = False
    if plan is None:
        return None
    return PackReport(plan, sum(r.linears for r in packed), sum(r.weight_bytes for r in packed),
                      max((r.max_rel_error for r in packed), default=0.0), tuple(kernel_table(model)))


def _current(model: torch.nn.Module, group: _Group) -> torch.Tensor:
    owner_name, _, attr = group.names[0].rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    return (owner._parameters if group.is_param else owner._buffers)[attr].detach()


def _pack_one(model, name: str, parts: list[_Group], plan: KernelPlan, check: bool) -> PackReport:
    """Pack one linear in place through pack_linears (its pack check included)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    original = getattr(parent, child)
    source = original.weight.data_ptr()
    holder = torch.nn.Module()
    holder.add_module("linear", original)
    report = pack_linears(holder, plan, check=check)
    packed = holder.linear
    if parts[0].mapped and _data_ptr(packed.packed_weight) == source:
        # A layout that keeps the weight as it is (dense-bf16) would keep the file's pages:
        # the replica's weights live in memory of their own.
        packed.packed_weight = packed.packed_weight.clone()
    setattr(parent, child, packed)
    return report


def _data_ptr(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.data_ptr()
    except (RuntimeError, NotImplementedError):  # an opaque (oneDNN) tensor: memory of its own
        return None


def _trim_heap() -> None:
    """Hand the C heap's free memory back to the system. A pack check's fp32 slices are
    below glibc's mmap threshold, so they come from the heap, and freed they stay resident
    (measured: the lm_head's check left ~0.4 GB of a Phi-3-mini load in RSS to its end)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def _no_meta_left(model: torch.nn.Module, folder: Path) -> None:
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_meta:
            raise CheckpointError(f"{folder}: {name} of {type(model).__name__} was not loaded")
