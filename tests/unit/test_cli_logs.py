"""-v / -vv configure the package's logging for real; records arrive as whole stderr lines."""

from __future__ import annotations

import logging

import pytest
from click.testing import CliRunner

from vcfslm.cli import main
from vcfslm.cli.logs import StderrLines, configure_logging


@pytest.fixture(autouse=True)
def restore_logger():
    logger = logging.getLogger("vcfslm")
    level, handlers = logger.level, list(logger.handlers)
    yield
    logger.setLevel(level)
    logger.handlers[:] = handlers


@pytest.mark.parametrize(("verbose", "level"), [(0, logging.WARNING), (1, logging.INFO),
                                                (2, logging.DEBUG), (5, logging.DEBUG)])
def test_levels(verbose, level):
    configure_logging(verbose)
    logger = logging.getLogger("vcfslm")
    assert logger.level == level
    assert sum(isinstance(h, StderrLines) for h in logger.handlers) == 1


def test_a_second_command_does_not_double_the_lines(capsys):
    configure_logging(2)
    configure_logging(2)
    logging.getLogger("vcfslm.vsphere.session").debug("login retry %d", 2)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].endswith("DEBUG vcfslm.vsphere.session: login retry 2")


@pytest.mark.parametrize(("flags", "seen"), [((), []), (("-v",), ["INFO"]), (("-vv",), ["DEBUG", "INFO"])])
def test_the_cli_flags_set_what_shows(capsys, flags, seen):
    # `validate` on a missing file fails (exit 2), but logging is configured before it runs
    result = CliRunner().invoke(main, [*flags, "validate", "/nonexistent.yaml"])
    assert result.exit_code == 2
    capsys.readouterr()
    logging.getLogger("vcfslm.guest.transport").debug("slm-01: SSH connect retry 1")
    logging.getLogger("vcfslm.engine.decode").info("compile: graph 1 done")
    err = capsys.readouterr().err.splitlines()
    assert [line.split()[1] for line in err] == seen
