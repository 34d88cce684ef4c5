"""Tags and content-library calls on mocked Automation SDK stubs (vcsim cannot speak the SDK)."""

from __future__ import annotations

from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest
import requests

from vcfslm.inventory import VCenter
from vcfslm.vsphere import tags
from vcfslm.vsphere.credentials import Secret

PASSWORD = "tag-secret-123"
CFG = VCenter(host="vcsa01", port=443, user="administrator@vsphere.local", ca_bundle="/etc/lab-ca.pem")


@pytest.fixture
def sdk(mocker):
    client = MagicMock(name="vsphere_client")
    create = mocker.patch.object(tags, "create_vsphere_client", return_value=client)
    return SimpleNamespace(client=client, create=create)


def connected() -> tags.AutomationClient:
    c = tags.AutomationClient(CFG, Secret(PASSWORD))
    c.connect()
    return c


def test_connect_verifies_tls_with_the_inventory_bundle(sdk):
    connected()
    kwargs = sdk.create.call_args.kwargs
    assert kwargs["server"] == "vcsa01:443" and kwargs["username"] == CFG.user
    assert kwargs["password"] == PASSWORD
    session = kwargs["session"]
    assert session.verify == "/etc/lab-ca.pem" and session.trust_env is False


def test_insecure_session_skips_verification(sdk):
    tags.AutomationClient(CFG.model_copy(update={"insecure": True}), Secret(PASSWORD)).connect()
    assert sdk.create.call_args.kwargs["session"].verify is False


def test_unreachable_api_is_automation_unavailable_without_the_password(sdk):
    sdk.create.side_effect = requests.HTTPError(f"404 for https://u:{PASSWORD}@vcsa01/api")
    with pytest.raises(tags.AutomationUnavailable) as err:
        connected()
    assert "not available" in str(err.value) and PASSWORD not in str(err.value)


def test_category_and_tag_are_created_once_and_attached_to_missing_vms(sdk):
    t = sdk.client.tagging
    t.Category.list.return_value = []
    t.Category.create.return_value = "cat-1"
    t.Tag.list_tags_for_category.return_value = []
    t.Tag.create.return_value = "tag-1"
    t.TagAssociation.list_attached_objects.return_value = [
        SimpleNamespace(type="VirtualMachine", id="vm-1")]
    attached = connected().attach("phi3-vx650v4", ["vm-1", "vm-2", "vm-3"])
    assert attached == ["vm-2", "vm-3"]
    cat_spec = t.Category.create.call_args.args[0]
    assert cat_spec.name == "vcfslm" and cat_spec.associable_types == {"VirtualMachine"}
    assert str(cat_spec.cardinality) == "MULTIPLE"
    tag_spec = t.Tag.create.call_args.args[0]
    assert (tag_spec.name, tag_spec.category_id) == ("phi3-vx650v4", "cat-1")
    tag_id, objs = t.TagAssociation.attach_tag_to_multiple_objects.call_args.args
    assert tag_id == "tag-1" and [(o.type, o.id) for o in objs] == [("VirtualMachine", "vm-2"),
                                                                    ("VirtualMachine", "vm-3")]


def test_existing_tag_is_reused_and_nothing_attached_when_all_carry_it(sdk):
    t = sdk.client.tagging
    t.Category.list.return_value = ["cat-0", "cat-1"]
    t.Category.get.side_effect = lambda cid: SimpleNamespace(name={"cat-0": "other", "cat-1": "vcfslm"}[cid])
    t.Tag.list_tags_for_category.return_value = ["tag-9"]
    t.Tag.get.return_value = SimpleNamespace(name="phi3-vx650v4")
    t.TagAssociation.list_attached_objects.return_value = [SimpleNamespace(type="VirtualMachine", id="vm-1")]
    assert connected().attach("phi3-vx650v4", ["vm-1"]) == []
    t.Category.create.assert_not_called()
    t.Tag.create.assert_not_called()
    t.TagAssociation.attach_tag_to_multiple_objects.assert_not_called()


def test_detach_removes_the_tag_once_unused(sdk):
    t = sdk.client.tagging
    t.Category.list.return_value = ["cat-1"]
    t.Category.get.return_value = SimpleNamespace(name="vcfslm")
    t.Tag.list_tags_for_category.return_value = ["tag-1"]
    t.Tag.get.return_value = SimpleNamespace(name="phi3-vx650v4")
    t.TagAssociation.list_attached_objects.return_value = []
    connected().detach("phi3-vx650v4", ["vm-1", "vm-2"])
    tag_id, objs = t.TagAssociation.detach_tag_from_multiple_objects.call_args.args
    assert tag_id == "tag-1" and [o.id for o in objs] == ["vm-1", "vm-2"]
    t.Tag.delete.assert_called_once_with("tag-1")


def test_detach_without_the_tag_does_nothing(sdk):
    t = sdk.client.tagging
    t.Category.list.return_value = []
    connected().detach("phi3-vx650v4", ["vm-1"])
    t.Category.create.assert_not_called()
    t.TagAssociation.detach_tag_from_multiple_objects.assert_not_called()


def test_close_ends_the_session(sdk):
    c = connected()
    c.close()
    sdk.client.session_svc.delete.assert_called_once()
    assert c.client is None


def test_library_deploy_calls(sdk):
    content = sdk.client.content
    content.Library.find.return_value = ["lib-1"]
    content.library.Item.find.return_value = ["item-1"]
    sdk.client.vcenter.ovf.LibraryItem.deploy.return_value = SimpleNamespace(
        succeeded=True, resource_id=SimpleNamespace(id="vm-42"))
    vm_id = connected().deploy("golden", "ubuntu", name="slm-01", folder="group-v3", host="host-1",
                               resource_pool="resgroup-1", datastore="datastore-1")
    assert vm_id == "vm-42"
    item, target, spec = sdk.client.vcenter.ovf.LibraryItem.deploy.call_args.args
    assert item == "item-1"
    assert (target.host_id, target.folder_id, target.resource_pool_id) == ("host-1", "group-v3", "resgroup-1")
    assert spec.name == "slm-01" and spec.default_datastore_id == "datastore-1"
