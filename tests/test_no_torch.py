"""The scheduler image carries no torch: importing any scheduler module must not import it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.processes   # runs another interpreter: not in `make test-fast`

# Runs in a fresh interpreter: a meta-path hook makes any attempt to import torch fail loudly, whether or
# not torch is installed, then every module of the package is imported.
PROBE = r"""
import importlib, pkgutil, sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("scheduler_service tried to import " + name)
        return None

sys.meta_path.insert(0, NoTorch())
import observability, scheduler_service, stepwire.contract, stepwire.internal
# The scheduler image also runs the shared packages: observability, the contract and the protos.
names = [m.name for pkg in (scheduler_service, observability, stepwire.contract, stepwire.internal)
         for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
for name in names:
    importlib.import_module(name)
assert "torch" not in sys.modules
print(len(names))
"""


def test_importing_every_scheduler_contract_and_observability_module_loads_no_torch():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.strip()) >= 20   # the walk really found the packages' modules


def test_the_grammar_package_the_gateway_shares_with_the_executor_loads_no_torch():
    """structured/ (llguidance) runs in the gateway, whose image has no torch: it must not need it."""
    probe = PROBE.replace("import observability, scheduler_service, stepwire.contract, stepwire.internal",
                          "import observability, scheduler_service, stepwire.contract, stepwire.internal, structured")
    probe = probe.replace("for pkg in (scheduler_service,", "for pkg in (structured, scheduler_service,")
    assert probe != PROBE
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
