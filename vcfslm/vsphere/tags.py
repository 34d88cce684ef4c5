"""The vSphere Automation SDK seam: the only module importing it (`com.vmware...`, `vmware.vapi...`).

Two jobs need the Automation API rather than the SOAP one: tags (category
`vcfslm`, one tag per inventory, attached to each VM so the cluster can be
found in the vSphere UI) and deploying a VM from a content-library OVF item
(`template: library:<lib>/<item>`). vcsim does not speak the SDK's JSON-RPC
endpoint: a connection failure is `AutomationUnavailable`, which callers treat
as a warning for tags (and a preflight problem for library templates).
"""

from __future__ import annotations

import ssl

import requests
from com.vmware.cis.tagging_client import Category, CategoryModel, Tag
from com.vmware.content.library_client import Item
from com.vmware.content_client import Library
from com.vmware.vapi.std_client import DynamicID
from com.vmware.vcenter.ovf_client import LibraryItem
from vmware.vapi.vsphere.client import create_vsphere_client

from ..errors import VCenterError
from .credentials import Secret

CATEGORY = "vcfslm"
VM_TYPE = "VirtualMachine"


def tls_session(vcenter) -> requests.Session:
    """A requests session trusting what the inventory says, like the pyVmomi session.

    trust_env is off because REQUESTS_CA_BUNDLE would silently replace vcenter.ca_bundle;
    without a bundle the system store is used (as ssl.create_default_context does).
    """
    session = requests.Session()
    session.trust_env = False
    if vcenter.insecure:
        session.verify = False
    else:
        session.verify = vcenter.ca_bundle or ssl.get_default_verify_paths().cafile or True
    return session


class AutomationUnavailable(VCenterError):
    """The Automation API (tags, content library) cannot be reached or refused us."""


class AutomationClient:
    """A session on vCenter's Automation API; use as a context manager (closes the session)."""

    def __init__(self, vcenter, password: Secret):
        self.cfg = vcenter
        self.password = password
        self.client = None

    def __enter__(self) -> AutomationClient:
        self.connect()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def connect(self) -> None:
        session = tls_session(self.cfg)
        try:
            self.client = create_vsphere_client(server=f"{self.cfg.host}:{self.cfg.port}",
                                                username=self.cfg.user,
                                                password=self.password.reveal(), session=session)
        except Exception as exc:  # any failure here means "no Automation API", whatever its kind
            session.close()
            raise AutomationUnavailable(self.password.scrub(
                f"Automation API at https://{self.cfg.host}:{self.cfg.port}/api is not available "
                f"({_reason(exc)})")) from None

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.session_svc.delete()
            except Exception:  # closing is best effort
                pass
            try:
                self.client.session.close()
            except Exception:
                pass
            self.client = None

    # ------------------------------------------------------------- tags

    def category_id(self, create: bool = True) -> str | None:
        """The `vcfslm` category's id, created (multiple tags per VM allowed) when missing."""
        cats = self.client.tagging.Category
        for cid in cats.list():
            if cats.get(cid).name == CATEGORY:
                return cid
        if not create:
            return None
        spec = Category.CreateSpec(name=CATEGORY, description="Clusters provisioned by vcfslm",
                               cardinality=CategoryModel.Cardinality.MULTIPLE,
                               associable_types={VM_TYPE})
        return cats.create(spec)

    def tag_id(self, name: str, create: bool = True) -> str | None:
        """The id of tag `name` in the vcfslm category (created when missing and `create`)."""
        cid = self.category_id(create=create)
        if cid is None:
            return None
        tags = self.client.tagging.Tag
        for tid in tags.list_tags_for_category(cid):
            if tags.get(tid).name == name:
                return tid
        if not create:
            return None
        return tags.create(Tag.CreateSpec(name=name, description=f"vcfslm inventory {name}",
                                           category_id=cid))

    def attach(self, name: str, vm_ids: list[str]) -> list[str]:
        """Attach tag `name` to the VMs (moref ids) that lack it; returns those attached now."""
        tid = self.tag_id(name)
        assoc = self.client.tagging.TagAssociation
        have = {obj.id for obj in assoc.list_attached_objects(tid) if obj.type == VM_TYPE}
        missing = [v for v in vm_ids if v not in have]
        if missing:
            assoc.attach_tag_to_multiple_objects(tid, [DynamicID(type=VM_TYPE, id=v) for v in missing])
        return missing

    def detach(self, name: str, vm_ids: list[str]) -> None:
        """Detach tag `name` from the VMs; delete the tag once nothing carries it."""
        tid = self.tag_id(name, create=False)
        if tid is None:
            return
        assoc = self.client.tagging.TagAssociation
        if vm_ids:
            assoc.detach_tag_from_multiple_objects(tid, [DynamicID(type=VM_TYPE, id=v) for v in vm_ids])
        if not list(assoc.list_attached_objects(tid)):
            self.client.tagging.Tag.delete(tid)

    # ------------------------------------------------------------- content library

    def library_items(self, library: str) -> set[str]:
        """Item names in content library `library` (empty when the library does not exist)."""
        lib_ids = self.client.content.Library.find(Library.FindSpec(name=library))
        names: set[str] = set()
        for lib_id in lib_ids:
            for item_id in self.client.content.library.Item.list(lib_id):
                names.add(self.client.content.library.Item.get(item_id).name)
        return names

    def deploy(self, library: str, item: str, name: str, folder: str, host: str,
               resource_pool: str, datastore: str) -> str:
        """Deploy OVF item `library/item` as VM `name`; returns the new VM's moref id."""
        lib_ids = self.client.content.Library.find(Library.FindSpec(name=library))
        item_ids = [i for lib_id in lib_ids
                    for i in self.client.content.library.Item.find(Item.FindSpec(name=item, library_id=lib_id))]
        if not item_ids:
            raise VCenterError(f"content library item {library}/{item} not found")
        target = LibraryItem.DeploymentTarget(resource_pool_id=resource_pool, host_id=host,
                                              folder_id=folder)
        spec = LibraryItem.ResourcePoolDeploymentSpec(name=name, accept_all_eula=True,
                                                      default_datastore_id=datastore)
        result = self.client.vcenter.ovf.LibraryItem.deploy(item_ids[0], target, spec)
        if not result.succeeded or result.resource_id is None:
            errors = getattr(getattr(result, "error", None), "errors", None) or []
            why = "; ".join(str(getattr(e, "category", e)) for e in errors) or "deploy failed"
            raise VCenterError(f"deploying {library}/{item} as {name}: {why}")
        return result.resource_id.id


def _reason(exc: BaseException) -> str:
    """A short reason: the innermost cause's type and first line."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    text = (str(exc).splitlines() or [""])[0][:160]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
