"""A package a playbook needs that the guest cannot install (an offline template without it):
the step fails naming the package and how to bake it into the template."""

from __future__ import annotations

import re

import pytest

from vcfslm.errors import PlaybookError
from vcfslm.guest.fake import FakeTransport
from vcfslm.guest.ops import Shell, execute
from vcfslm.guest.software_steps import PackagesStep, missing_packages_message


def test_the_message_names_the_packages_and_how_to_bake_them():
    one = missing_packages_message("apt", ["numactl"])
    assert one.startswith("apt could not install numactl: missing from the guest")
    assert "offline guest" in one
    assert "Bake it into the template: run `apt-get install -y numactl` in the template VM" in one
    assert "TEMPLATE_PACKAGES" in one and "debootstrap" in one
    two = missing_packages_message("dnf", ["numactl", "procps-ng"])
    assert "numactl, procps-ng" in two and "dnf install -y numactl procps-ng" in two
    assert "Bake them into the template" in two


class _Ctx:
    """What PackagesStep.plan reads: one cached fact."""

    def __init__(self, state):
        self.state = state

    def fact(self, fact):
        return self.state


def test_the_install_command_carries_the_message():
    from vcfslm.guest import facts as F

    step = PackagesStep(apt=["numactl", "python3"], dnf=["numactl"])
    [op] = step.plan(_Ctx(F.Packages("apt", frozenset({"python3"}))), sudo=False)
    assert op.cmd.endswith("apt-get install -y -qq --no-install-recommends numactl")
    assert op.failure == missing_packages_message("apt", ["numactl"])


def test_a_failing_install_raises_the_message_above_the_command_and_its_output():
    transport = FakeTransport("slm-01", {
        "apt-get install -y jq": (100, "", "E: Unable to locate package jq")})
    op = Shell("apt-get install -y jq", failure=missing_packages_message("apt", ["jq"]))
    with pytest.raises(PlaybookError) as info:
        execute(op, transport, 60)
    text = str(info.value)
    assert text.splitlines()[0] == missing_packages_message("apt", ["jq"])
    assert re.search(r"command failed \(exit 100\): apt-get install -y jq", text)
    assert "Unable to locate package jq" in text


def test_other_commands_fail_as_before():
    from vcfslm.errors import CommandFailed

    transport = FakeTransport("slm-01", {"false": (1, "", "no")})
    with pytest.raises(CommandFailed):
        execute(Shell("false"), transport, 60)
