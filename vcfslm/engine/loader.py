"""Load a safetensors checkpoint into a meta-device skeleton at about one copy of its weights.

`from_pretrained` followed by packing holds the checkpoint and the packed model at once
(measured on an AMX Xeon: 2.1x the weights at its peak). Here the tensors are taken a few
at a time instead, on stock APIs only:

1. The model is a skeleton built on the meta device (`vcfslm.engine.model.load_checkpoint`:
   `torch.device("meta")`, then its non-persistent buffers computed for real).
2. The checkpoint is read with safetensors' `safe_open`, which maps the file: a tensor it
   returns is a view of the mapping, read from disk as it is touched. The mapping lives as
   long as the handle and any view taken from it; once they are dropped it is unmapped, and
   the pages it read are page cache again, no process's memory.
3. Tensors are put in the model with `load_state_dict(..., assign=True)` (gpt-fast's
   pattern); a tensor stored in another dtype is converted first (a copy). Tied names
   (lm_head on embed_tokens) get one Parameter for all of them, so a tie stays a tie.
4. With a `before_pack` hook, every tensor is first assigned as a view of one handle per
   file, and the hook runs once on the whole model, mapped and not yet packed (a reference
   forward pass reads the mapped pages; nothing is copied for it). The views then go back
   to the meta device and the handles are dropped, which gives back every page it read.
5. Unit by unit, largest first (a linear with its weight and bias, or any other tensor),
   each from a handle opened for it and dropped after it: an nn.Linear is packed as soon
   as its weight is in (`linear.pack_linears` on that one linear, its pack check
   included); every other tensor, and every weight a plan keeps as it is (dense-bf16), is
   copied into memory of its own. The peak is then the weights settled so far plus the
   unit at hand held twice (source and result), never the checkpoint and the packed model
   together; largest first puts the biggest double holdings where the least is settled.

Without a plan, every tensor is copied into memory of its own (the engine packs later, one
linear at a time, dropping each original as it goes): the peak is again one copy.

A model packed here carries its PackReport (`packed_report`): the engine keeps it and packs
nothing again.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoint_files import CheckpointError, TensorEntry, checkpoint_entries, open_file
from .linear import DENSE_BF16, KernelPlan, PackReport, kernel_table, pack_linears

PACK_REPORT_ATTR = "vcfslm_pack_report"


def mark_packed(model: torch.nn.Module, report: PackReport) -> None:
    """Record that `model`'s linears are packed, and how."""
    object.__setattr__(model, PACK_REPORT_ATTR, report)


def packed_report(model: torch.nn.Module) -> PackReport | None:
    """The PackReport of a model packed by its loader, None for a model still to pack."""
    return model.__dict__.get(PACK_REPORT_ATTR)


@dataclass(eq=False)
class _Group:
    """One tensor of the model and every name it goes by (several for tied weights)."""

    names: list[str]
    like: torch.Tensor
    entry: TensorEntry | None = None
    mapped: bool = False                               # assigned as a view of a mapped file
    linears: list[str] = field(default_factory=list)   # linears whose weight or bias it is
    elsewhere: bool = False                            # also used outside those linears


class _Files:
    """safe_open handles, one per file, opened on first use; `close` drops them (and with
    them, once no view of it is left, each file's mapping)."""

    def __init__(self):
        self.handles: dict[Path, object] = {}

    def tensor(self, entry: TensorEntry) -> torch.Tensor:
        handle = self.handles.get(entry.path)
        if handle is None:
            handle = self.handles[entry.path] = open_file(entry.path)
        return handle.get_tensor(entry.name)

    def close(self) -> None:
        self.handles.clear()


def load_weights(model: torch.nn.Module, folder: Path, *, plan: KernelPlan | None = None,
                 before_pack: Callable[[torch.nn.Module], None] | None = None,
                 check: bool = True) -> PackReport | None:
    """Fill a meta-device skeleton from the checkpoint in `folder` (see the module
    docstring); with a plan, pack every nn.Linear as it arrives. The PackReport, or None
    without a plan. Raises CheckpointError naming the folder and the tensor when the file and
    the model disagree (a name only one of them has, a shape, a dtype)."""
    folder = Path(folder)
    groups = _groups(model)
    by_name = {name: g for g in groups for name in g.names}
    arch = type(model).__name__
    for entry in checkpoint_entries(folder):
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
    linears = _linears(model, by_name)
    # The skeleton's objects are long-lived: keep them out of the collections pack_linears runs.
    gc.freeze()
    try:
        if before_pack is not None:
            _before_pack(model, groups, before_pack)
        report = _settle(model, groups, linears, plan, check)
    finally:
        gc.unfreeze()
    _no_meta_left(model, folder)
    if report is not None:
        mark_packed(model, report)
    return report


def _groups(model: torch.nn.Module) -> list[_Group]:
    """The model's persistent tensors, tied names together, in state_dict order."""
    groups: dict[int, _Group] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if not isinstance(tensor, torch.Tensor):
            continue
        group = groups.get(id(tensor))
        if group is None:
            groups[id(tensor)] = _Group([name], tensor)
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


def _owner(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    owner_name, _, attr = name.rpartition(".")
    return (model.get_submodule(owner_name) if owner_name else model), attr


def _assign(model: torch.nn.Module, group: _Group, tensor: torch.Tensor) -> None:
    """Put `tensor` under every name of `group` with load_state_dict(assign=True): the first
    name's module takes it, the others (a tie) get that same Parameter."""
    owner, attr = _owner(model, group.names[0])
    owner.load_state_dict({attr: tensor}, strict=False, assign=True)
    value = getattr(owner, attr)
    for name in group.names[1:]:
        other, other_attr = _owner(model, name)
        setattr(other, other_attr, value)


def _current(model: torch.nn.Module, group: _Group) -> torch.Tensor:
    owner, attr = _owner(model, group.names[0])
    return getattr(owner, attr).detach()


def _read(files: _Files, group: _Group) -> tuple[torch.Tensor, bool]:
    """The group's tensor in the model's dtype, and whether it is a view of its file (a tensor
    stored in another dtype is converted: a copy of its own)."""
    entry, want = group.entry, group.like.dtype
    tensor = files.tensor(entry)
    if tensor.dtype == want:
        return tensor, True
    if not (tensor.is_floating_point() and want.is_floating_point):
        raise CheckpointError(f"{entry.path.parent}: tensor {entry.name} is {entry.dtype}; the model holds {want}")
    # Converted through a handle of its own, dropped at once: the source's pages (twice the
    # result's for fp32) are given back as soon as the copy exists.
    del tensor
    return open_file(entry.path).get_tensor(entry.name).to(want), False


def _before_pack(model: torch.nn.Module, groups: list[_Group], hook: Callable[[torch.nn.Module], None]) -> None:
    """Run `hook` once on the whole model with every tensor a view of its mapped file, then
    put the views back on the meta device and drop the handles: the pages its forward pass
    read are given back before packing starts, or the peak would be the checkpoint plus the
    packed model after all (a page packed later is read again from the page cache). A
    converted tensor (a copy of its own) stays."""
    files = _Files()
    try:
        for group in groups:
            tensor, group.mapped = _read(files, group)
            _assign(model, group, tensor)
            del tensor
        hook(model)
    finally:
        for group in groups:
            if group.mapped:
                _assign(model, group, torch.empty_like(group.like, device="meta"))
                group.mapped = False
        files.close()


def _settle(model, groups, linears, plan, check) -> PackReport | None:
    """Load every unit (a linear's weight and bias, or a tensor of no linear), largest first,
    packing each linear as it arrives; each unit's handles are dropped once it is done."""
    units: list[tuple[int, str | None, list[_Group]]] = [
        (max(g.entry.numel for g in parts), name, parts) for name, parts in linears.items()]
    units += [(g.entry.numel, None, [g]) for g in groups if not g.linears]
    # Largest first: while a unit is copied or packed it is held twice (its source and its
    # result), and the first ones are held twice on top of the least settled memory.
    units.sort(key=lambda u: -u[0])
    # dense-bf16 keeps a weight as it is: the weight is copied out of its file and packed from
    # the copy; other layouts pack straight from the mapped view.
    copy_all = plan is None or plan.kernel == DENSE_BF16
    packed: list[PackReport] = []
    for _, name, parts in units:
        files = _Files()
        for group in parts:
            if not _current(model, group).is_meta:  # loaded already (a tie, or converted before the hook)
                continue
            tensor, mapped = _read(files, group)
            # A tensor that outlives this unit (another linear's, or used elsewhere) gets
            # memory of its own; so does every tensor the plan will not pack into a copy.
            if mapped and (copy_all or group.elsewhere or len(group.linears) > 1 or name is None):
                tensor = tensor.clone()
            _assign(model, group, tensor)
            del tensor
        if name is not None and plan is not None:
            packed.append(_pack_one(model, name, plan, check))
        files.close()
    if plan is None:
        return None
    return PackReport(plan, sum(r.linears for r in packed), sum(r.weight_bytes for r in packed),
                      max((r.max_rel_error for r in packed), default=0.0), tuple(kernel_table(model)))


def _pack_one(model: torch.nn.Module, name: str, plan: KernelPlan, check: bool) -> PackReport:
    """Pack one linear in place through pack_linears (its pack check included); the original
    (and any view of a mapped file it held) is dropped."""
    parent, child = _owner(model, name)
    holder = torch.nn.Module()
    holder.add_module("linear", getattr(parent, child))
    report = pack_linears(holder, plan, check=check)
    setattr(parent, child, holder.linear)
    return report


def _no_meta_left(model: torch.nn.Module, folder: Path) -> None:
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_meta:
            raise CheckpointError(f"{folder}: {name} of {type(model).__name__} was not loaded")
