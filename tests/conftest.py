"""Shared pytest setup: the local lab's fixtures (vcsim, sshd guests) as a plugin."""

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

pytest_plugins = ["lab_fixtures"] if importlib.util.find_spec("lab_fixtures") else []
