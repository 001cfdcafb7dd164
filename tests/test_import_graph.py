"""No service imports another: each imports only itself, the contract, the generated protos, observability and
security. The `stepwire` package (the bottom) imports no service and nothing above; only `launcher` (the
top) composes services, and nothing below imports it. No import cycle anywhere.

Inside each service, rooms by capability stand on floors: a subpackage imports only those below it (the scheduler's
core/ nothing else of the scheduler, the executor's kernels/ nothing else of the executor), and no folder of
runtime code holds more than 16 modules.

The services ship as separate images and scale separately; a service that reaches into another's modules
drags that service's dependencies and assumptions into its own pod. The check reads every import
statement, those inside functions too, so a lazy import cannot slip past it.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIRST_PARTY = {"scheduler_service", "executor_service", "gateway", "observability", "security", "stepwire", "tools",
               "bench", "tests", "helpers", "launcher", "structured"}
SHARED = {"stepwire.contract", "stepwire.v1", "stepwire.internal", "observability", "security"}
# Each package (a folder under the repository root) and the first-party modules it may import.
RULES = {
    "scheduler_service": {"scheduler_service"} | SHARED,
    # structured/ (grammars) is shared by the two services that need it, never the scheduler's: no llguidance there.
    "executor_service": {"executor_service", "structured"} | SHARED,
    "gateway": {"gateway", "structured"} | SHARED,
    "structured": {"structured", "stepwire.contract", "stepwire.internal"},
    "observability": {"observability"},
    "security": {"security", "stepwire.contract"},
    "stepwire": {"stepwire"},
    "stepwire/contract": {"stepwire.contract", "stepwire.v1", "stepwire.internal"},
    "stepwire/v1": {"stepwire.v1", "stepwire.internal"},
    "stepwire/internal": {"stepwire.internal"},
}


def _floors(service: str, floors: list[str], extra: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each subpackage of `service` (listed from the ground up) may import itself and those listed before it."""
    out = {}
    for i, sub in enumerate(floors):
        out[f"{service}/{sub}"] = {f"{service}.{s}" for s in floors[:i + 1]} | extra.get(sub, set()) | SHARED
    return out


# The executor: kernels, then one step's rows, the model, the KV cache, adapters, speculation, the runner, the API.
RULES |= _floors("executor_service", ["kernels", "batch", "model", "kv", "lora", "spec", "engine", "api"],
                 {s: {"structured"} for s in ("batch", "model", "kv", "lora", "spec", "engine", "api")})
for sub in ("kv", "lora"):     # side by side: neither imports the other
    RULES[f"executor_service/{sub}"] -= {"executor_service.kv", "executor_service.lora"} - {f"executor_service.{sub}"}
# The scheduler: the vLLM core on the ground; the process's settings (a module at the root) above it.
RULES |= _floors("scheduler_service", ["core", "telemetry", "fleet", "api"],
                 {s: {"scheduler_service.settings"} for s in ("fleet", "api")})
RULES["scheduler_service/membership"] = {"scheduler_service.membership", "scheduler_service.settings"} | SHARED
# The gateway: the edge's checks, text and tool calling side by side, the generation both APIs share, then the APIs.
RULES |= {f"gateway/{s}": {f"gateway.{s}"} | SHARED for s in ("access", "text")}
RULES["gateway/tools"] = {"gateway.tools", "structured"} | SHARED
RULES |= _floors("gateway", ["generation", "http_api", "grpc_api"],
                 {s: {"gateway.access", "gateway.text", "gateway.tools", "structured"}
                  for s in ("generation", "http_api", "grpc_api")})


pytestmark = pytest.mark.processes   # starts services as separate processes: not in `make test-fast`


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


def test_every_runtime_folder_holds_at_most_16_modules_and_says_what_it_holds():
    crowded, silent = [], []
    for service in ("scheduler_service", "executor_service", "gateway"):
        for folder in [ROOT / service, *(p.parent for p in (ROOT / service).rglob("__init__.py"))]:
            modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
            if len(modules) > 16:
                crowded.append(f"{folder.relative_to(ROOT)}: {len(modules)}")
            init = folder / "__init__.py"
            if folder != ROOT / service and not (init.is_file() and init.read_text().startswith('"""')):
                silent.append(str(folder.relative_to(ROOT)))
    assert crowded == [] and silent == []


def test_the_floors_rule_catches_a_kernel_that_imports_the_runner(tmp_path):
    pkg = tmp_path / "kernels"
    pkg.mkdir()
    (pkg / "gemm.py").write_text("from executor_service.kernels import fixed_order\n"
                                 "from executor_service.engine.runner import ModelRunner\n")
    assert violations(pkg, RULES["executor_service/kernels"]) == [
        "kernels/gemm.py:2 imports executor_service.engine.runner"]
    assert RULES["scheduler_service/core"] == {"scheduler_service.core"} | SHARED


def test_the_check_catches_a_service_that_imports_another(tmp_path):
    pkg = tmp_path / "gateway"
    pkg.mkdir()
    (pkg / "ok.py").write_text("import json\nfrom stepwire.contract import SamplingParams\nimport observability\n")
    (pkg / "bad.py").write_text("import grpc\n\n\ndef later():\n"
                                "    from scheduler_service.core.request import Request\n")
    (pkg / "worse.py").write_text("import executor_service.engine.runner as r\nfrom launcher import engine\n")
    found = violations(pkg, RULES["gateway"])
    assert found == ["gateway/bad.py:5 imports scheduler_service.core.request", "gateway/worse.py:1 imports "
                     "executor_service.engine.runner", "gateway/worse.py:2 imports launcher"]


# ---- cycles ----------------------------------------------------------------------------------------------------

RUNTIME = ["stepwire", "security", "observability", "structured", "scheduler_service", "executor_service", "gateway",
           "launcher"]


def module_graph(root: Path, packages: list[str]) -> dict[str, set[str]]:
    """module -> the first-party modules it imports (a `from a import b` counts as a.b where that is a module)."""
    names = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
             for pkg in packages for p in (root / pkg).rglob("*.py")}
    graph = {}
    for name, path in names.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names else node.module
                         for a in node.names}
        graph[name] = {d for d in deps if d in names and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_back_through_others():
    assert cycles(module_graph(ROOT, RUNTIME)) == []


def test_the_cycle_check_finds_a_cycle_through_three_modules(tmp_path):
    pkg = tmp_path / "gateway"
    pkg.mkdir()
    (pkg / "a.py").write_text("from gateway import b\n")
    (pkg / "b.py").write_text("import gateway.c\n")
    (pkg / "c.py").write_text("def later():\n    from gateway.a import x\n")
    (pkg / "d.py").write_text("import gateway.a\n")
    assert cycles(module_graph(tmp_path, ["gateway"])) == [["gateway.a", "gateway.b", "gateway.c"]]


# ---- one launcher ------------------------------------------------------------------------------------------------

def hand_built_command_lines(root: Path, folders=("tests", "bench")) -> list[str]:
    """Strings in test and benchmark code that run a service's module themselves (the module's name as a word
    of a command line, or after `-m` in one string): every stack starts through launcher/processes.py, which
    alone knows the modules, so that a new flag or fault hook is written once and serve and the tests run the
    same lines."""
    from launcher.processes import MODULE

    out = []
    for path in sorted(p for folder in folders for p in (root / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str | bytes)):
                continue
            text = node.value.decode(errors="replace") if isinstance(node.value, bytes) else node.value
            if any(text == m or f"-m {m}" in text for m in MODULE.values()):
                out.append(f"{path.relative_to(root)}:{node.lineno} {text!r}")
    return out


def test_no_test_or_benchmark_builds_a_service_command_line_by_hand():
    assert hand_built_command_lines(ROOT) == []


def test_the_command_line_check_finds_one_built_by_hand(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        '"""Talks to executor_service.server directly."""\nfrom executor_service.server import main\n'
        'cmd = [sys.executable, "-m", "scheduler_service.server", "--address", a]\n'
        'shell = f"python -m gateway' + '.server --port {port}"\n')   # (split: this file must pass the check)
    assert hand_built_command_lines(tmp_path, ("tests",)) == [
        "tests/test_x.py:3 'scheduler_service.server'", "tests/test_x.py:4 'python -m gateway" + ".server --port '"]
