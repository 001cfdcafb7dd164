"""No service imports another: each imports only itself, the contract, the generated protos, observability and
security.

The services ship as separate images and scale separately; a service that reaches into another's modules
drags that service's dependencies and assumptions into its own pod. The check reads every import
statement, those inside functions too, so a lazy import cannot slip past it.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIRST_PARTY = {"scheduler_service", "executor_service", "gateway", "observability", "security", "stepwire", "tools",
               "bench", "tests", "helpers"}
SHARED = {"stepwire.contract", "stepwire.v1", "stepwire.internal", "observability", "security"}
# Each package (a folder under the repository root) and the first-party modules it may import.
RULES = {
    "scheduler_service": {"scheduler_service"} | SHARED,
    "executor_service": {"executor_service"} | SHARED,
    "gateway": {"gateway"} | SHARED,
    "observability": {"observability"},
    "security": {"security", "stepwire.contract"},
    "stepwire/contract": {"stepwire.contract", "stepwire.v1", "stepwire.internal"},
    "stepwire/v1": {"stepwire.v1", "stepwire.internal"},
    "stepwire/internal": {"stepwire.internal"},
}


def imported_modules(source: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"line {node.lineno}: relative import; the check needs absolute ones")
            found.append((node.lineno, node.module or ""))
    return found


def violations(package_dir: Path, allowed: set[str]) -> list[str]:
    out = []
    for path in sorted(package_dir.rglob("*.py")):
        for line, module in imported_modules(path.read_text()):
            if module.split(".")[0] not in FIRST_PARTY:
                continue   # the standard library or a third-party package
            if not any(module == a or module.startswith(a + ".") for a in allowed):
                out.append(f"{path.relative_to(package_dir.parent)}:{line} imports {module}")
    return out


@pytest.mark.parametrize("package", sorted(RULES))
def test_a_service_imports_only_itself_the_contract_the_protos_and_observability(package):
    directory = ROOT / package
    assert any(directory.rglob("*.py")), f"{package} has no modules: the rule checks nothing"
    assert violations(directory, RULES[package]) == []


def test_the_check_catches_a_service_that_imports_another(tmp_path):
    pkg = tmp_path / "gateway"
    pkg.mkdir()
    (pkg / "ok.py").write_text("import json\nfrom stepwire.contract import SamplingParams\nimport observability\n")
    (pkg / "bad.py").write_text("import grpc\n\n\ndef later():\n    from scheduler_service.request import Request\n")
    (pkg / "worse.py").write_text("import executor_service.runner as r\nfrom stepwire import engine\n")
    found = violations(pkg, RULES["gateway"])
    assert found == ["gateway/bad.py:5 imports scheduler_service.request", "gateway/worse.py:1 imports "
                     "executor_service.runner", "gateway/worse.py:2 imports stepwire"]
