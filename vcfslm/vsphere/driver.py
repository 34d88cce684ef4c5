"""The pyVmomi driver: `PyVmomiVCenter` composes the session, the snapshot parser,
the spec builder and the task waiter.

`observe` reads the placement objects and VMs in one property-collector round
trip; `worker(name)` makes one VM's changes, with a waiter (a private property
collector) of its own. The pool that runs every VM's worker at once, so one VM's
failure never stops the others, is `reconcile.apply_plan` / `destroy_vms`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from pyVmomi import vim, vmodl

from .. import node_selection
from ..errors import VCenterError
from ..progress import Reporter
from . import snapshot, specs
from .changes import (
    Change,
    CloneVm,
    Customize,
    PowerOff,
    PowerOn,
    Reconfigure,
    Relocate,
    UpgradeHardware,
    WaitForIp,
)
from .credentials import Secret
from .desired import DesiredVm
from .session import Session, SessionOptions
from .snapshot import Refs
from .state import Snapshot, VmState
from .tasks import TaskFailed, Waiter

log = logging.getLogger(__name__)

# snapshot.PROPERTIES' type names -> the managed object types asked for
TYPES = {
    "Datacenter": vim.Datacenter, "Folder": vim.Folder, "ComputeResource": vim.ComputeResource,
    "HostSystem": vim.HostSystem, "Datastore": vim.Datastore, "Network": vim.Network,
    "DistributedVirtualPortgroup": vim.dvs.DistributedVirtualPortgroup,
    "DistributedVirtualSwitch": vim.DistributedVirtualSwitch, "ResourcePool": vim.ResourcePool,
    "VirtualMachine": vim.VirtualMachine,
}
# (traversal name, from type, property it follows, traversals taken from there)
TRAVERSALS = (
    ("folder", vim.Folder, "childEntity",
     ("folder", "dc_vm", "dc_host", "dc_ds", "dc_net", "cr_host", "cr_rp", "rp_rp")),
    ("dc_vm", vim.Datacenter, "vmFolder", ("folder",)),
    ("dc_host", vim.Datacenter, "hostFolder", ("folder",)),
    ("dc_ds", vim.Datacenter, "datastoreFolder", ("folder",)),
    ("dc_net", vim.Datacenter, "networkFolder", ("folder",)),
    ("cr_host", vim.ComputeResource, "host", ()),
    ("cr_rp", vim.ComputeResource, "resourcePool", ("rp_rp",)),
    ("rp_rp", vim.ResourcePool, "resourcePool", ("rp_rp",)),
)


class PyVmomiVCenter:
    """VCenter implementation over pyVmomi; use as a context manager (closes the session).

    vcenter: the inventory's vcenter section; password: a Secret; max_workers: VMs
    handled at once (the CLI resolves it with node_selection.parallelism); None = every VM up
    to node_selection.VCENTER_PARALLEL_CAP; task_timeout, ip_timeout: seconds a task / a guest
    IP may take; options: retries, backoff, API pin and throttling (session.SessionOptions).
    """

    def __init__(self, vcenter, password: Secret, reporter: Reporter | None = None,
                 max_workers: int | None = None, task_timeout: float = 3600.0,
                 ip_timeout: float = 900.0, options: SessionOptions | None = None):
        # One HTTPS connection per worker, plus the calling thread's (observe, folders).
        pool = (max_workers or node_selection.VCENTER_PARALLEL_CAP) + 1
        self.session = Session(vcenter, password, reporter, options or SessionOptions(), pool_size=pool,
                               parallel=max_workers)
        self.reporter = self.session.reporter
        self.max_workers = max_workers
        self.task_timeout = task_timeout
        self.ip_timeout = ip_timeout
        self.refs = Refs()
        self._folder_lock = threading.Lock()

    def __enter__(self) -> PyVmomiVCenter:
        self.connect()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def connect(self) -> None:
        self.session.connect()

    def close(self) -> None:
        self.session.close()

    def error_text(self, exc: BaseException) -> str:
        """A one-line message for `exc`, the password masked."""
        return self.session.text(exc)

    # ------------------------------------------------------------- observe

    def observe(self, inv) -> Snapshot:
        """Placement objects and VMs of the inventory's datacenter, in one RetrieveContents."""
        s = self.session
        api, session_api = s.api_version, s.session_api_version
        # Ask only for what the session's release has (config.numaInfo from 8.0.0.1).
        objects = s.call(s.content.propertyCollector.RetrieveContents, [self._filter_spec(s.observed_api)])
        place = inv.placement
        snap, self.refs = snapshot.parse(snapshot.found(objects), place.datacenter, place.cluster, api,
                                         session_api, bool(s.api_pin))
        log.debug("observed %d object(s) on vCenter API %s (session API %s): %d VM(s) in %s",
                  len(objects or []), api, session_api, len(snap.vms), place.datacenter)
        return snap

    def read_vm(self, vm) -> VmState | None:
        """One VM's properties, as observe reads them (None when nothing came back)."""
        s = self.session
        PC = vmodl.query.PropertyCollector
        paths = snapshot.properties(s.observed_api)["VirtualMachine"]
        spec = PC.FilterSpec(objectSet=[PC.ObjectSpec(obj=vm, skip=False)],
                             propSet=[PC.PropertySpec(type=vim.VirtualMachine, pathSet=paths)])
        records = snapshot.found(s.call(s.content.propertyCollector.RetrieveContents, [spec]))
        if not records:
            return None
        r = records[0]
        return snapshot.vm_state(r.moref, r.props, {}, self.refs.network_names(), None)

    def _filter_spec(self, api: str):
        PC = vmodl.query.PropertyCollector
        traversals = [PC.TraversalSpec(name=name, type=kind, path=path, skip=False,
                                       selectSet=[PC.SelectionSpec(name=n) for n in follow])
                      for name, kind, path, follow in TRAVERSALS]
        props = [PC.PropertySpec(type=TYPES[kind], pathSet=paths)
                 for kind, paths in snapshot.properties(api).items()]
        return PC.FilterSpec(objectSet=[PC.ObjectSpec(obj=self.session.content.rootFolder, skip=False,
                                                      selectSet=traversals)],
                             propSet=props)

    # ------------------------------------------------------------- apply

    def ensure_folder(self, path: str):
        """The VM folder at `path` under the datacenter's VM folder, created level by level."""
        path = path.strip("/")
        folders = self.refs.folders
        with self._folder_lock:
            if path in folders:
                return folders[path]
            parent = self.refs.vm_root
            if parent is None:
                raise VCenterError("datacenter VM folder unknown (observe first)")
            walked = []
            for part in path.split("/") if path else []:
                walked.append(part)
                sub = "/".join(walked)
                if sub not in folders:
                    log.debug("creating VM folder %s", sub)
                    try:
                        folders[sub] = self.session.call(parent.CreateFolder, name=part, idempotent=False)
                    except vim.fault.DuplicateName as exc:
                        folders[sub] = exc.object
                parent = folders[sub]
            return folders.get(path, self.refs.vm_root)

    def worker(self, name: str, library_deploy: Callable[..., str] | None = None) -> VmWorker:
        """The worker that changes VM `name` (enter it to get its waiter).

        library_deploy: callable(library, item, name, placement ids) -> VM moref id,
        for `template: library:<lib>/<item>` (provided by vsphere.tags).
        """
        return VmWorker(self, name, library_deploy)


class VmWorker:
    """Makes one VM's changes in order; a context manager owning the VM's task waiter."""

    def __init__(self, vc: PyVmomiVCenter, name: str, library_deploy: Callable[..., str] | None = None):
        self.vc = vc
        self.name = name
        self.library_deploy = library_deploy
        self.call = vc.session.call
        self.vm = vc.refs.vms.get(name)
        self.waiter: Waiter | None = None

    @property
    def moref(self) -> str | None:
        """The VM's moref id (None until it exists)."""
        return self.vm._moId if self.vm is not None else None

    def __enter__(self) -> VmWorker:
        self.waiter = Waiter(self.vc.session, self.vc.task_timeout)
        return self

    def __exit__(self, *exc) -> None:
        if self.waiter is not None:
            self.waiter.close()
            self.waiter = None

    def apply(self, change: Change, desired: DesiredVm) -> str | None:
        """Make one change; returns the guest's IPv4 address for WaitForIp, else None."""
        if isinstance(change, CloneVm):
            self.vm = self._clone(change, desired)
            return None
        vm, w, refs = self.vm, self.waiter, self.vc.refs
        if vm is None:
            raise VCenterError(f"VM {change.vm} not found")
        if isinstance(change, Reconfigure):
            devices = (self.call(lambda: vm.config.hardware.device)
                       if specs.needs_devices(change.fields) else None)
            spec = specs.config_spec(change.fields, desired, refs, devices)
            w.run(f"reconfigure {self.name}", vm.ReconfigVM_Task, spec=spec)
        elif isinstance(change, Relocate):
            self._relocate(vm, desired)
        elif isinstance(change, UpgradeHardware):
            w.run(f"upgrade {self.name} to {change.new}", vm.UpgradeVM_Task, version=change.new)
        elif isinstance(change, PowerOff):
            self._power(vm.PowerOffVM_Task, "power off")
        elif isinstance(change, PowerOn):
            self._power(vm.PowerOnVM_Task, "power on")
        elif isinstance(change, Customize):
            w.run(f"customize {self.name}", vm.CustomizeVM_Task, spec=specs.customization_spec(desired))
            w.run(f"mark {self.name} customized", vm.ReconfigVM_Task, spec=specs.customization_mark(desired))
        elif isinstance(change, WaitForIp):
            return w.ipv4(vm, change.portgroup, self.vc.ip_timeout)
        else:
            raise VCenterError(f"unknown change {change.kind}")
        return None

    def read_back(self) -> VmState | None:
        """The VM as vCenter reports it now (config.numaInfo where the API has it)."""
        return self.vc.read_vm(self.vm) if self.vm is not None else None

    def power_off(self) -> None:
        self._power(self.vm.PowerOffVM_Task, "power off")

    def destroy(self) -> None:
        self.waiter.run(f"destroy {self.name}", self.vm.Destroy_Task)
        self.vc.refs.vms.pop(self.name, None)

    def _power(self, method, what: str) -> None:
        try:
            # Safe to repeat: a second power operation fails with InvalidPowerState.
            self.waiter.run(f"{what} {self.name}", method, idempotent=True)
        except vim.fault.InvalidPowerState:
            log.debug("%s: already in the wanted power state (%s)", self.name, what)
        except TaskFailed as exc:
            if not isinstance(exc.__cause__, vim.fault.InvalidPowerState):
                raise
            log.debug("%s: already in the wanted power state (%s)", self.name, what)

    def _clone(self, change: CloneVm, desired: DesiredVm):
        refs = self.vc.refs
        host, datastore, pool = specs.placement(desired, refs)
        folder = self.vc.ensure_folder(change.folder)
        if desired.template.startswith("library:"):
            if self.library_deploy is None:
                raise VCenterError("content-library templates need the Automation API, which is "
                                   "not available")
            lib, item = desired.template[len("library:"):].split("/", 1)
            log.debug("deploying content-library item %s/%s as %s", lib, item, change.vm)
            vm_id = self.library_deploy(lib, item, name=change.vm, folder=folder._moId,
                                        host=host._moId, resource_pool=pool._moId,
                                        datastore=datastore._moId)
            vm = vim.VirtualMachine(vm_id, self.vc.session.si._stub)
            self.waiter.run(f"mark {change.vm} owned", vm.ReconfigVM_Task, spec=specs.owner_mark(change.owner))
        else:
            template = refs.vms.get(desired.template)
            if template is None:
                raise VCenterError(f"template {desired.template} not found")
            vm = self.waiter.run(f"clone {desired.template} -> {change.vm}", template.CloneVM_Task,
                                 folder=folder, name=change.vm,
                                 spec=specs.clone_spec(desired, refs, change.owner))
        refs.vms[change.vm] = vm
        # Some servers (vcsim) place the clone on the template's host: move it where it belongs.
        current = self.call(lambda: vm.runtime.host)
        if current is None or current._moId != host._moId:
            log.debug("%s: placed on %s, not on %s: migrating", change.vm,
                      getattr(current, "_moId", None), host._moId)
            self._relocate(vm, desired)
        return vm

    def _relocate(self, vm, desired: DesiredVm) -> None:
        spec = specs.relocate_spec(desired, self.vc.refs)
        self.waiter.run(f"migrate {desired.name} to {desired.host}", vm.RelocateVM_Task, spec=spec)
