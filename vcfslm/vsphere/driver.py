"""The pyVmomi driver: the only module that imports pyVmomi.

`PyVmomiVCenter` connects (TLS verified unless `insecure: true`, which warns),
observes the placement objects and VMs in one property-collector round trip,
and applies a plan: every VM in its own worker of a bounded pool, so the tasks
of all VMs are fired together and waited on together; one VM's failure never
stops the others. Task and guest-IP waits use a private property collector per
worker with WaitForUpdatesEx (no sleep-polling). Session expiry is healed by
logging in again; connection resets are retried with backoff for calls that are
safe to repeat.
"""

from __future__ import annotations

import http.client
import ipaddress
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pyVim.connect import Disconnect, SmartConnect
from pyVmomi import vim, vmodl

from ..errors import VCenterError
from ..progress import NullReporter, Reporter
from .changes import (
    Change,
    CloneVm,
    CreateFolder,
    Customize,
    DestroyPlan,
    FieldChange,
    Plan,
    PowerOff,
    PowerOn,
    Reconfigure,
    Relocate,
    UpgradeHardware,
    VmPlan,
    WaitForIp,
)
from .credentials import Secret, ssl_context
from .desired import CUSTOMIZATION_KEY, OWNER_KEY, VNUMA_API, DesiredVm, parse_version
from .state import HostFacts, Snapshot, VmState

TRANSIENT = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError,
             http.client.RemoteDisconnected, http.client.IncompleteRead)
VM_PROPERTIES = [
    "name", "parent", "config.template", "config.version", "config.hardware.numCPU",
    "config.hardware.numCoresPerSocket", "config.hardware.memoryMB", "config.hardware.device",
    "config.extraConfig", "config.memoryReservationLockedToMax", "config.cpuHotAddEnabled",
    "config.cpuAllocation", "config.memoryAllocation", "config.latencySensitivity",
    "runtime.powerState", "runtime.host", "guest.net",
]


@dataclass
class VmOutcome:
    """How one VM ended: status ok | failed | blocked; `step` is the last step attempted."""

    name: str
    status: str
    message: str = ""
    step: str = ""
    moref: str | None = None
    ip: str | None = None
    pending: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class _Refs:
    """Managed objects found by the last observe, by name or path."""

    datacenter: Any = None
    vm_root: Any = None
    cluster: Any = None
    folders: dict[str, Any] = field(default_factory=dict)
    hosts: dict[str, Any] = field(default_factory=dict)
    datastores: dict[str, Any] = field(default_factory=dict)
    networks: dict[str, Any] = field(default_factory=dict)
    dvportgroups: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (key, switch uuid)
    pools: dict[str, Any] = field(default_factory=dict)  # "" = the cluster's root pool
    vms: dict[str, Any] = field(default_factory=dict)


class TaskFailed(VCenterError):
    """A vCenter task ended in error."""


def fault_text(exc: BaseException) -> str:
    """A one-line message for a pyVmomi fault or any exception."""
    if isinstance(exc, vmodl.MethodFault):
        msg = getattr(exc, "msg", None) or ""
        for fm in getattr(exc, "faultMessage", None) or []:
            msg = msg or getattr(fm, "message", "")
        return f"{type(exc).__name__.split('.')[-1]}: {msg}".rstrip(": ") if msg else \
            type(exc).__name__.split(".")[-1]
    return str(exc) or type(exc).__name__


class PyVmomiVCenter:
    """VCenter implementation over pyVmomi; use as a context manager (closes the session).

    vcenter: the inventory's vcenter section; password: a Secret; max_workers: VMs
    handled at once; library_deploy: callable(library, item, name, placement ids) ->
    VM moref id, for `template: library:<lib>/<item>` (provided by vsphere.tags).
    """

    def __init__(self, vcenter, password: Secret, reporter: Reporter | None = None,
                 max_workers: int = 16, task_timeout: float = 3600.0, ip_timeout: float = 900.0,
                 retries: int = 4, backoff: float = 0.5,
                 library_deploy: Callable[..., str] | None = None):
        self.cfg = vcenter
        self.password = password
        self.reporter = reporter or NullReporter()
        self.max_workers = max_workers
        self.task_timeout = task_timeout
        self.ip_timeout = ip_timeout
        self.retries = retries
        self.backoff = backoff
        self.library_deploy = library_deploy
        self.si = None
        self._content = None
        self.refs = _Refs()
        self._login_lock = threading.Lock()
        self._folder_lock = threading.Lock()

    # ------------------------------------------------------------- session

    def __enter__(self) -> PyVmomiVCenter:
        self.connect()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def connect(self) -> None:
        cfg = self.cfg
        if cfg.insecure:
            self.reporter.log(f"warning: TLS certificate verification is OFF for {cfg.host} "
                              "(vcenter.insecure: true); anyone on the path can read the password")
        try:
            ctx = ssl_context(cfg.ca_bundle, cfg.insecure)
        except (OSError, ssl.SSLError) as exc:
            raise VCenterError(f"cannot read vcenter.ca_bundle {cfg.ca_bundle}: {exc}") from None
        try:
            self.si = SmartConnect(host=cfg.host, port=cfg.port, user=cfg.user,
                                   pwd=self.password.reveal(), sslContext=ctx)
        except vim.fault.InvalidLogin:
            raise VCenterError(f"vCenter {cfg.host} refused the login of {cfg.user}") from None
        except ssl.SSLCertVerificationError as exc:
            raise VCenterError(f"TLS verification of {cfg.host}:{cfg.port} failed ({exc.verify_message}); "
                               "set vcenter.ca_bundle to the CA that signed its certificate") from None
        except (OSError, ssl.SSLError, http.client.HTTPException) as exc:
            raise VCenterError(self.password.scrub(
                f"cannot reach vCenter {cfg.host}:{cfg.port}: {exc}")) from None
        except vmodl.MethodFault as exc:
            raise VCenterError(self.password.scrub(f"vCenter {cfg.host}: {fault_text(exc)}")) from None

    def close(self) -> None:
        if self.si is not None:
            try:
                Disconnect(self.si)
            except Exception:  # the session may already be gone; closing is best effort
                pass
            self.si = None
            self._content = None

    @property
    def content(self):
        """The service content, fetched once per session (each `si.content` is a round trip)."""
        if self.si is None:
            raise VCenterError("not connected to vCenter")
        if self._content is None:
            self._content = self.si.RetrieveContent()
        return self._content

    @property
    def api_version(self) -> str:
        return self.content.about.apiVersion

    def _relogin(self) -> None:
        with self._login_lock:
            sm = self.content.sessionManager
            try:
                if sm.currentSession is not None:
                    return  # another worker already logged in again
            except vim.fault.NotAuthenticated:
                pass
            self.reporter.log("vCenter session expired: logging in again")
            sm.Login(self.cfg.user, self.password.reveal())

    def call(self, fn: Callable, *args, idempotent: bool = True, **kwargs):
        """fn(*args) with session-expiry healing; connection resets retried when idempotent."""
        delay = self.backoff
        for attempt in range(self.retries + 1):
            try:
                return fn(*args, **kwargs)
            except vim.fault.NotAuthenticated:
                # Refused before anything happened: safe to repeat any call.
                if attempt == self.retries:
                    raise
                self._relogin()
            except TRANSIENT:
                if not idempotent or attempt == self.retries:
                    raise
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    # ------------------------------------------------------------- observe

    def observe(self, inv) -> Snapshot:
        """Placement objects and VMs of the inventory's datacenter, in one RetrieveContents."""
        api = self.api_version
        objects = self.call(self.content.propertyCollector.RetrieveContents,
                            [self._filter_spec(api)])
        return self._snapshot(inv, api, objects)

    def _filter_spec(self, api: str):
        PC = vmodl.query.PropertyCollector
        T = PC.TraversalSpec

        def sel(name: str):
            return PC.SelectionSpec(name=name)

        everything = [sel(n) for n in ("folder", "dc_vm", "dc_host", "dc_ds", "dc_net", "cr_host",
                                       "cr_rp", "rp_rp")]
        traversals = [
            T(name="folder", type=vim.Folder, path="childEntity", skip=False, selectSet=everything),
            T(name="dc_vm", type=vim.Datacenter, path="vmFolder", skip=False, selectSet=[sel("folder")]),
            T(name="dc_host", type=vim.Datacenter, path="hostFolder", skip=False, selectSet=[sel("folder")]),
            T(name="dc_ds", type=vim.Datacenter, path="datastoreFolder", skip=False,
              selectSet=[sel("folder")]),
            T(name="dc_net", type=vim.Datacenter, path="networkFolder", skip=False,
              selectSet=[sel("folder")]),
            T(name="cr_host", type=vim.ComputeResource, path="host", skip=False),
            T(name="cr_rp", type=vim.ComputeResource, path="resourcePool", skip=False,
              selectSet=[sel("rp_rp")]),
            T(name="rp_rp", type=vim.ResourcePool, path="resourcePool", skip=False,
              selectSet=[sel("rp_rp")]),
        ]
        vm_props = list(VM_PROPERTIES)
        if parse_version(api) >= VNUMA_API:
            vm_props.append("config.numaInfo")
        props = [
            PC.PropertySpec(type=vim.Datacenter, pathSet=["name", "parent", "vmFolder"]),
            PC.PropertySpec(type=vim.Folder, pathSet=["name", "parent"]),
            PC.PropertySpec(type=vim.ComputeResource, pathSet=["name", "parent", "resourcePool"]),
            PC.PropertySpec(type=vim.HostSystem, pathSet=[
                "name", "parent", "hardware.numaInfo", "hardware.memorySize", "summary.hardware.cpuMhz",
                "config.product.apiVersion", "runtime.connectionState"]),
            PC.PropertySpec(type=vim.Datastore, pathSet=["name", "parent"]),
            PC.PropertySpec(type=vim.Network, pathSet=["name", "parent"]),
            PC.PropertySpec(type=vim.dvs.DistributedVirtualPortgroup,
                            pathSet=["key", "config.distributedVirtualSwitch"]),
            PC.PropertySpec(type=vim.DistributedVirtualSwitch, pathSet=["uuid"]),
            PC.PropertySpec(type=vim.ResourcePool, pathSet=["name", "parent"]),
            PC.PropertySpec(type=vim.VirtualMachine, pathSet=vm_props),
        ]
        return PC.FilterSpec(objectSet=[PC.ObjectSpec(obj=self.content.rootFolder, skip=False,
                                                      selectSet=traversals)],
                             propSet=props)

    def _snapshot(self, inv, api: str, objects) -> Snapshot:
        props: dict[str, dict[str, Any]] = {}
        objs: dict[str, Any] = {}
        for oc in objects or []:
            key = oc.obj._moId
            objs[key] = oc.obj
            props[key] = {p.name: p.val for p in (oc.propSet or [])}

        def moid(ref) -> str | None:
            return ref._moId if ref is not None else None

        def is_a(key: str, kind) -> bool:
            return isinstance(objs[key], kind)

        def ancestors(key: str):
            seen = set()
            parent = moid(props.get(key, {}).get("parent"))
            while parent and parent not in seen and parent in props:
                seen.add(parent)
                yield parent
                parent = moid(props[parent].get("parent"))

        place = inv.placement
        refs = _Refs()
        dc_key = next((k for k, o in objs.items() if isinstance(o, vim.Datacenter)
                       and props[k].get("name") == place.datacenter), None)
        if dc_key is None:
            self.refs = refs
            return Snapshot(api_version=api)
        refs.datacenter = objs[dc_key]
        vm_root = moid(props[dc_key].get("vmFolder"))
        refs.vm_root = objs.get(vm_root)
        inside = {k for k in objs if dc_key in set(ancestors(k))}

        def path_under(key: str, root: str | None) -> str | None:
            names = [props[key].get("name", "")]
            for a in ancestors(key):
                if a == root:
                    return "/".join(reversed(names))
                names.append(props[a].get("name", ""))
            return None

        folders = {"": vm_root}
        for k in inside:
            if is_a(k, vim.Folder) and k != vm_root:
                p = path_under(k, vm_root)
                if p is not None:
                    folders[p] = k
        refs.folders = {p: objs[k] for p, k in folders.items() if k in objs}

        cluster_key = next((k for k in inside if isinstance(objs[k], vim.ClusterComputeResource)
                            and props[k].get("name") == place.cluster), None)
        pools: dict[str, Any] = {}
        if cluster_key is not None:
            refs.cluster = objs[cluster_key]
            root_pool = moid(props[cluster_key].get("resourcePool"))
            if root_pool in objs:
                pools[""] = objs[root_pool]
                for k in inside:
                    if is_a(k, vim.ResourcePool) and k != root_pool:
                        p = path_under(k, root_pool)
                        if p is not None:
                            pools[p] = objs[k]
        refs.pools = pools

        hosts: dict[str, HostFacts] = {}
        host_names: dict[str, str] = {}
        for k in inside:
            if not is_a(k, vim.HostSystem):
                continue
            p = props[k]
            parent = moid(p.get("parent"))
            cluster = (props[parent].get("name") if parent in objs
                       and isinstance(objs[parent], vim.ClusterComputeResource) else None)
            numa = p.get("hardware.numaInfo")
            name = p.get("name", k)
            host_names[k] = name
            refs.hosts[name] = objs[k]
            hosts[name] = HostFacts(
                name=name, cluster=cluster, numa_nodes=int(getattr(numa, "numNodes", 0) or 0),
                memory_bytes=int(p.get("hardware.memorySize") or 0),
                cpu_mhz=int(p.get("summary.hardware.cpuMhz") or 0),
                api_version=str(p.get("config.product.apiVersion") or ""),
                connection_state=str(p.get("runtime.connectionState") or "connected"))

        switch_uuid = {k: props[k].get("uuid") for k in objs if isinstance(objs[k], vim.DistributedVirtualSwitch)}
        pg_key_to_name: dict[str, str] = {}
        for k in inside:
            if is_a(k, vim.Datastore):
                refs.datastores[props[k]["name"]] = objs[k]
            elif is_a(k, vim.Network):
                name = props[k].get("name", k)
                refs.networks[name] = objs[k]
                if is_a(k, vim.dvs.DistributedVirtualPortgroup):
                    pg_key = props[k].get("key") or k
                    dvs = moid(props[k].get("config.distributedVirtualSwitch"))
                    refs.dvportgroups[name] = (pg_key, switch_uuid.get(dvs) or "")
                    pg_key_to_name[pg_key] = name

        vms: dict[str, VmState] = {}
        duplicates: set[str] = set()
        for k in inside:
            if not is_a(k, vim.VirtualMachine):
                continue
            state = self._vm_state(k, props[k], host_names, pg_key_to_name,
                                   path_under(k, vm_root) if vm_root else None)
            if state.name in vms:
                duplicates.add(state.name)
            vms[state.name] = state
            refs.vms[state.name] = objs[k]
        self.refs = refs
        return Snapshot(
            api_version=api, datacenter=place.datacenter,
            cluster=place.cluster if cluster_key else None, hosts=hosts,
            datastores=frozenset(refs.datastores), networks=frozenset(refs.networks),
            folders=frozenset(p for p in folders if p), resource_pools=frozenset(p for p in pools if p),
            vms=vms, duplicate_vms=frozenset(duplicates))

    @staticmethod
    def _vm_state(key: str, p: dict[str, Any], host_names: dict[str, str],
                  pg_key_to_name: dict[str, str], path: str | None) -> VmState:
        extra: dict[str, str] = {}
        for opt in p.get("config.extraConfig") or []:
            extra[opt.key] = str(opt.value)  # later entries win (vcsim appends on reconfigure)
        devices = p.get("config.hardware.device") or []
        nics = [d for d in devices if isinstance(d, vim.vm.device.VirtualEthernetCard)]
        nics.sort(key=lambda d: d.key)
        nic_names = tuple(_backing_name(d, pg_key_to_name) for d in nics)
        ips: list[str] = []
        first_key = nics[0].key if nics else None
        first_net = nic_names[0] if nic_names else None
        for g in p.get("guest.net") or []:
            if g.deviceConfigId == first_key or (first_net and g.network == first_net):
                ips.extend(a for a in (g.ipAddress or []) if _usable_ipv4(a))
        cpu = p.get("config.cpuAllocation")
        mem = p.get("config.memoryAllocation")
        lat = p.get("config.latencySensitivity")
        numa = p.get("config.numaInfo")
        host = p.get("runtime.host")
        folder = path.rsplit("/", 1)[0] if path and "/" in path else ("" if path else None)
        return VmState(
            name=p.get("name", key), moref=key, power_state=str(p.get("runtime.powerState") or "poweredOff"),
            template=bool(p.get("config.template")), host=host_names.get(host._moId) if host else None,
            folder=folder, hardware_version=p.get("config.version"),
            num_cpus=p.get("config.hardware.numCPU"), cores_per_socket=p.get("config.hardware.numCoresPerSocket"),
            memory_mb=p.get("config.hardware.memoryMB"),
            memory_locked_to_max=p.get("config.memoryReservationLockedToMax"),
            memory_reservation_mb=getattr(mem, "reservation", None),
            cpu_hot_add=p.get("config.cpuHotAddEnabled"),
            latency_sensitivity=str(lat.level) if lat is not None and lat.level else None,
            cpu_reservation_mhz=getattr(cpu, "reservation", None),
            cores_per_numa_node=getattr(numa, "coresPerNumaNode", None),
            extra_config=extra, nics=nic_names, ip_addresses=tuple(dict.fromkeys(ips)))

    # ------------------------------------------------------------- apply

    def apply(self, plan: Plan, reporter: Reporter | None = None) -> list[VmOutcome]:
        """Execute a plan; one outcome per VM in plan order."""
        reporter = reporter or self.reporter
        folder_error = None
        for change in plan.cluster_changes:
            if isinstance(change, CreateFolder):
                try:
                    reporter.log(f"creating folder {change.path}")
                    self.ensure_folder(change.path)
                except Exception as exc:  # every VM in that folder fails below, with this reason
                    folder_error = f"cannot create folder {change.path}: {self._text(exc)}"
        todo = [v for v in plan.vms if v.action in ("create", "update") or v.changes]
        results: dict[str, VmOutcome] = {}
        for v in plan.vms:
            if v.action == "blocked":
                results[v.name] = VmOutcome(v.name, "blocked", "; ".join(v.problems))
                reporter.update(v.name, "blocked: " + "; ".join(v.problems))
            elif v not in todo:
                results[v.name] = self._in_sync(v)
                reporter.update(v.name, "in sync")
        if folder_error:
            for v in todo:
                results[v.name] = VmOutcome(v.name, "failed", folder_error, "create folder")
            todo = []
        if todo:
            with ThreadPoolExecutor(max_workers=max(1, min(self.max_workers, len(todo))),
                                    thread_name_prefix="vcfslm-vm") as pool:
                for outcome in pool.map(lambda vp: self._apply_vm(vp, reporter), todo):
                    results[outcome.name] = outcome
        return [results[v.name] for v in plan.vms]

    def _in_sync(self, v: VmPlan) -> VmOutcome:
        obs = v.observed
        return VmOutcome(v.name, "ok", "in sync", moref=obs.moref if obs else None,
                         ip=obs.ip_addresses[0] if obs and obs.ip_addresses else None,
                         pending=[f.describe() for f in v.pending])

    def _apply_vm(self, vp: VmPlan, reporter: Reporter) -> VmOutcome:
        name = vp.name
        outcome = VmOutcome(name, "ok", vp.action, pending=[f.describe() for f in vp.pending])
        vm = self.refs.vms.get(name)
        waiter = None
        try:
            waiter = _Waiter(self)
            for change in vp.changes:
                outcome.step = change.kind
                reporter.update(name, _step_label(change))
                vm = self._apply_change(change, vm, vp.desired, waiter, outcome)
            outcome.moref = vm._moId if vm is not None else None
            done = "created" if vp.action == "create" else ("updated" if vp.change_count else "in sync")
            if outcome.ip:
                done += f", {outcome.ip}"
            if vp.pending:
                done += f", {len(vp.pending)} change(s) pending a restart"
            reporter.update(name, done)
        except Exception as exc:  # one VM's failure must not stop the others
            outcome.status = "failed"
            outcome.message = f"{outcome.step}: {self._text(exc)}"
            outcome.moref = vm._moId if vm is not None else None
            reporter.update(name, f"failed at {outcome.step}: {self._text(exc)}")
        finally:
            if waiter is not None:
                waiter.close()
        return outcome

    def _text(self, exc: BaseException) -> str:
        return self.password.scrub(fault_text(exc))

    def _apply_change(self, change: Change, vm, desired: DesiredVm, waiter: _Waiter, outcome: VmOutcome):
        if isinstance(change, CloneVm):
            return self._clone(change, desired, waiter)
        if vm is None:
            raise VCenterError(f"VM {change.vm} not found")
        if isinstance(change, Reconfigure):
            spec = self.config_spec(change.fields, desired, vm)
            waiter.task(self.call(vm.ReconfigVM_Task, spec=spec, idempotent=False))
        elif isinstance(change, Relocate):
            self._relocate(vm, desired, waiter)
        elif isinstance(change, UpgradeHardware):
            waiter.task(self.call(vm.UpgradeVM_Task, version=change.new, idempotent=False))
        elif isinstance(change, PowerOff):
            self._power(vm, vm.PowerOffVM_Task, waiter)
        elif isinstance(change, PowerOn):
            self._power(vm, vm.PowerOnVM_Task, waiter)
        elif isinstance(change, Customize):
            spec = customization_spec(desired)
            waiter.task(self.call(vm.CustomizeVM_Task, spec=spec, idempotent=False))
            # Remember what the guest was customized with: a later diff re-customizes on change.
            mark = vim.vm.ConfigSpec(extraConfig=[vim.option.OptionValue(
                key=CUSTOMIZATION_KEY, value=desired.customization_fingerprint)])
            waiter.task(self.call(vm.ReconfigVM_Task, spec=mark, idempotent=False))
        elif isinstance(change, WaitForIp):
            outcome.ip = waiter.ipv4(vm, change.portgroup, self.ip_timeout)
        else:
            raise VCenterError(f"unknown change {change.kind}")
        return vm

    def _power(self, vm, method, waiter: _Waiter) -> None:
        try:
            waiter.task(self.call(method))
        except vim.fault.InvalidPowerState:
            pass  # already in the wanted state (a re-run after a lost reply)
        except TaskFailed as exc:
            if not isinstance(exc.__cause__, vim.fault.InvalidPowerState):
                raise

    def _placement(self, desired: DesiredVm):
        r = self.refs
        host = r.hosts.get(desired.host)
        if host is None:
            raise VCenterError(f"ESXi host {desired.host} not found")
        datastore = r.datastores.get(desired.datastore)
        if datastore is None:
            raise VCenterError(f"datastore {desired.datastore} not found")
        pool = r.pools.get((desired.resource_pool or "").strip("/"))
        if pool is None:
            raise VCenterError(f"resource pool {desired.resource_pool or '(cluster root)'} not found")
        return host, datastore, pool

    def _clone(self, change: CloneVm, desired: DesiredVm, waiter: _Waiter):
        host, datastore, pool = self._placement(desired)
        folder = self.ensure_folder(change.folder)
        if desired.template.startswith("library:"):
            if self.library_deploy is None:
                raise VCenterError("content-library templates need the Automation API, which is "
                                   "not available")
            lib, item = desired.template[len("library:"):].split("/", 1)
            vm_id = self.library_deploy(lib, item, name=change.vm, folder=folder._moId,
                                        host=host._moId, resource_pool=pool._moId,
                                        datastore=datastore._moId)
            vm = vim.VirtualMachine(vm_id, self.si._stub)
            mark = vim.vm.ConfigSpec(extraConfig=[vim.option.OptionValue(key=OWNER_KEY, value=change.owner)])
            waiter.task(self.call(vm.ReconfigVM_Task, spec=mark, idempotent=False))
        else:
            template = self.refs.vms.get(desired.template)
            if template is None:
                raise VCenterError(f"template {desired.template} not found")
            spec = vim.vm.CloneSpec(
                location=vim.vm.RelocateSpec(host=host, datastore=datastore, pool=pool),
                powerOn=False, template=False,
                # The owner marker is on from birth, so an interrupted create can be resumed.
                config=vim.vm.ConfigSpec(extraConfig=[vim.option.OptionValue(key=OWNER_KEY,
                                                                             value=change.owner)]))
            vm = waiter.task(self.call(template.CloneVM_Task, folder=folder, name=change.vm, spec=spec,
                                       idempotent=False))
        self.refs.vms[change.vm] = vm
        # Some servers (vcsim) place the clone on the template's host: move it where it belongs.
        current = self.call(lambda: vm.runtime.host)
        if current is None or current._moId != host._moId:
            self._relocate(vm, desired, waiter)
        return vm

    def _relocate(self, vm, desired: DesiredVm, waiter: _Waiter) -> None:
        host, _, pool = self._placement(desired)
        spec = vim.vm.RelocateSpec(host=host, pool=pool)
        waiter.task(self.call(vm.RelocateVM_Task, spec=spec, idempotent=False))

    def ensure_folder(self, path: str):
        """The VM folder at `path` under the datacenter's VM folder, created level by level."""
        path = path.strip("/")
        with self._folder_lock:
            if path in self.refs.folders:
                return self.refs.folders[path]
            parent = self.refs.vm_root
            if parent is None:
                raise VCenterError("datacenter VM folder unknown (observe first)")
            walked = []
            for part in path.split("/") if path else []:
                walked.append(part)
                sub = "/".join(walked)
                if sub not in self.refs.folders:
                    try:
                        self.refs.folders[sub] = self.call(parent.CreateFolder, name=part, idempotent=False)
                    except vim.fault.DuplicateName as exc:
                        self.refs.folders[sub] = exc.object
                parent = self.refs.folders[sub]
            return self.refs.folders.get(path, self.refs.vm_root)

    # ------------------------------------------------------------- specs

    def config_spec(self, fields: tuple[FieldChange, ...], desired: DesiredVm, vm):
        """A ConfigSpec setting exactly `fields` to their new values."""
        spec = vim.vm.ConfigSpec()
        extra = []
        for f in fields:
            if f.field == "num_cpus":
                spec.numCPUs = f.new
            elif f.field == "cores_per_socket":
                spec.numCoresPerSocket = f.new
            elif f.field == "memory_mb":
                spec.memoryMB = f.new
            elif f.field == "memory_locked_to_max":
                spec.memoryReservationLockedToMax = f.new
            elif f.field == "memory_reservation_mb":
                spec.memoryAllocation = vim.ResourceAllocationInfo(reservation=f.new)
            elif f.field == "cpu_hot_add":
                spec.cpuHotAddEnabled = f.new
            elif f.field == "cpu_reservation_mhz":
                spec.cpuAllocation = vim.ResourceAllocationInfo(reservation=f.new)
            elif f.field == "latency_sensitivity":
                spec.latencySensitivity = vim.LatencySensitivity(level=f.new)
            elif f.field == "cores_per_numa_node":
                spec.virtualNuma = vim.vm.VirtualNuma(coresPerNumaNode=f.new)
            elif f.field.startswith("extra_config:"):
                extra.append(vim.option.OptionValue(key=f.field.split(":", 1)[1], value=f.new))
            elif f.field == "nics":
                devices = self.call(lambda: vm.config.hardware.device)
                spec.deviceChange = self.nic_changes(devices, desired)
            else:
                raise VCenterError(f"unknown field {f.field}")
        if extra:
            spec.extraConfig = extra
        return spec

    def _backing(self, portgroup: str):
        if portgroup in self.refs.dvportgroups:
            key, uuid = self.refs.dvportgroups[portgroup]
            return vim.vm.device.VirtualEthernetCard.DistributedVirtualPortBackingInfo(
                port=vim.dvs.PortConnection(portgroupKey=key, switchUuid=uuid))
        net = self.refs.networks.get(portgroup)
        if net is None:
            raise VCenterError(f"port group {portgroup} not found")
        return vim.vm.device.VirtualEthernetCard.NetworkBackingInfo(deviceName=portgroup, network=net)

    def nic_changes(self, devices, desired: DesiredVm) -> list:
        """Device changes giving the VM one adapter per desired port group, in order."""
        pg_names = {key: name for name, (key, _) in self.refs.dvportgroups.items()}
        nics = sorted((d for d in devices or [] if isinstance(d, vim.vm.device.VirtualEthernetCard)),
                      key=lambda d: d.key)
        Spec = vim.vm.device.VirtualDeviceSpec
        out = []
        for i, nic_want in enumerate(desired.nics):
            if i < len(nics):
                if _backing_name(nics[i], pg_names) != nic_want.portgroup:
                    nics[i].backing = self._backing(nic_want.portgroup)
                    out.append(Spec(operation=Spec.Operation.edit, device=nics[i]))
            else:
                card = vim.vm.device.VirtualVmxnet3(
                    key=-(100 + i), backing=self._backing(nic_want.portgroup),
                    connectable=vim.vm.device.VirtualDevice.ConnectInfo(
                        startConnected=True, allowGuestControl=True, connected=True))
                out.append(Spec(operation=Spec.Operation.add, device=card))
        for extra in nics[len(desired.nics):]:
            out.append(Spec(operation=Spec.Operation.remove, device=extra))
        return out

    # ------------------------------------------------------------- destroy

    def destroy(self, dplan: DestroyPlan, reporter: Reporter | None = None) -> list[VmOutcome]:
        """Power off and destroy the plan's owned VMs, all at once."""
        reporter = reporter or self.reporter
        if not dplan.destroy:
            return []
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_workers, len(dplan.destroy))),
                                thread_name_prefix="vcfslm-destroy") as pool:
            return list(pool.map(lambda s: self._destroy_vm(s, reporter), dplan.destroy))

    def _destroy_vm(self, state: VmState, reporter: Reporter) -> VmOutcome:
        vm = self.refs.vms.get(state.name)
        outcome = VmOutcome(state.name, "ok", "destroyed", moref=state.moref)
        waiter = None
        try:
            waiter = _Waiter(self)
            if state.power_state != "poweredOff":
                outcome.step = "power-off"
                reporter.update(state.name, "powering off")
                self._power(vm, vm.PowerOffVM_Task, waiter)
            outcome.step = "destroy"
            reporter.update(state.name, "destroying")
            waiter.task(self.call(vm.Destroy_Task, idempotent=False))
            self.refs.vms.pop(state.name, None)
            reporter.update(state.name, "destroyed")
        except Exception as exc:  # the others go on
            outcome.status = "failed"
            outcome.message = f"{outcome.step}: {self._text(exc)}"
            reporter.update(state.name, f"failed at {outcome.step}: {self._text(exc)}")
        finally:
            if waiter is not None:
                waiter.close()
        return outcome


class _Waiter:
    """Waits for tasks and guest IPs through a private property collector (WaitForUpdatesEx)."""

    def __init__(self, vc: PyVmomiVCenter):
        self.vc = vc
        self.pc = vc.call(vc.content.propertyCollector.CreatePropertyCollector)

    def close(self) -> None:
        try:
            self.pc.DestroyPropertyCollector()
        except Exception:  # best effort: the session may be gone
            pass

    def _wait(self, obj, paths: list[str], done: Callable[[dict[str, Any]], Any], timeout: float,
              what: str):
        PC = vmodl.query.PropertyCollector
        spec = PC.FilterSpec(objectSet=[PC.ObjectSpec(obj=obj, skip=False)],
                             propSet=[PC.PropertySpec(type=type(obj), pathSet=paths)])
        flt = self.vc.call(self.pc.CreateFilter, spec, partialUpdates=True)
        try:
            values: dict[str, Any] = {}
            version = ""
            deadline = time.monotonic() + timeout
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise VCenterError(f"timed out after {timeout:.0f} s waiting for {what}")
                options = PC.WaitOptions(maxWaitSeconds=max(1, min(int(remaining), 60)))
                update = self.vc.call(self.pc.WaitForUpdatesEx, version, options)
                if update is None:
                    continue
                version = update.version
                for fs in update.filterSet or []:
                    for oc in fs.objectSet or []:
                        for change in oc.changeSet or []:
                            values[change.name] = None if change.op == "remove" else change.val
                result = done(values)
                if result is not None:
                    return result
        finally:
            try:
                flt.Destroy()
            except Exception:  # already gone with the collector
                pass

    def task(self, task, timeout: float | None = None):
        """The task's result once it succeeds; TaskFailed (cause: the fault) when it fails."""
        def done(v: dict[str, Any]):
            state = v.get("info.state")
            if state == vim.TaskInfo.State.success:
                return (v.get("info.result"),)
            if state == vim.TaskInfo.State.error:
                fault = v.get("info.error")
                raise TaskFailed(self.vc._text(fault) if fault is not None else "task failed") from fault
            return None

        return self._wait(task, ["info.state", "info.error", "info.result"], done,
                          timeout or self.vc.task_timeout, "a task")[0]

    def ipv4(self, vm, portgroup: str, timeout: float) -> str:
        """The first usable IPv4 address the guest reports on the `portgroup` adapter."""
        devices = self.vc.call(lambda: vm.config.hardware.device) or []
        nic_keys = sorted(d.key for d in devices if isinstance(d, vim.vm.device.VirtualEthernetCard))
        first_key = nic_keys[0] if nic_keys else None

        def done(v: dict[str, Any]):
            for g in v.get("guest.net") or []:
                if g.network == portgroup or g.deviceConfigId == first_key:
                    for a in g.ipAddress or []:
                        if _usable_ipv4(a):
                            return a
            return None

        return self._wait(vm, ["guest.net"], done, timeout, f"an IPv4 address on {portgroup}")


def _usable_ipv4(text: str) -> bool:
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return False
    return ip.version == 4 and not ip.is_link_local and not ip.is_unspecified


def _backing_name(device, pg_key_to_name: dict[str, str]) -> str:
    backing = device.backing
    if isinstance(backing, vim.vm.device.VirtualEthernetCard.DistributedVirtualPortBackingInfo):
        key = backing.port.portgroupKey if backing.port else None
        return pg_key_to_name.get(key, key or "?")
    if isinstance(backing, vim.vm.device.VirtualEthernetCard.NetworkBackingInfo):
        return backing.deviceName or (backing.network.name if backing.network else "?")
    return type(backing).__name__


def _step_label(change: Change) -> str:
    labels = {"clone": "cloning", "reconfigure": "reconfiguring", "relocate": "migrating",
              "upgrade-hardware": "upgrading hardware", "power-off": "powering off",
              "power-on": "powering on", "customize": "customizing guest",
              "wait-ip": "waiting for an IPv4 address"}
    return labels.get(change.kind, change.kind)


def customization_spec(desired: DesiredVm):
    """Linux guest customization: hostname, static IPv4 on each NIC, gateway and DNS."""
    C = vim.vm.customization
    adapters = []
    for nic in desired.nics:
        ip = C.IPSettings(ip=C.FixedIp(ipAddress=nic.ip), subnetMask=nic.netmask)
        if nic.gateway:
            ip.gateway = [nic.gateway]
        if nic.dns:
            ip.dnsServerList = list(nic.dns)
        adapters.append(C.AdapterMapping(adapter=ip))
    dns = list(dict.fromkeys(d for nic in desired.nics for d in nic.dns))
    return C.Specification(
        identity=C.LinuxPrep(hostName=C.FixedName(name=desired.hostname), domain="localdomain",
                             hwClockUTC=True),
        globalIPSettings=C.GlobalIPSettings(dnsServerList=dns),
        nicSettingMap=adapters)
