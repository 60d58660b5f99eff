"""Every test that takes ``rc`` runs once per engine and storage: the compiled core and the
pure-Python reference on numpy storage, and the compiled core on torch storage (``cpu``, moved
through index arrays as on a GPU), all behind the one facade.  ``rc`` is used like
``import recurrent_cache as rc``; its ``RecurrentCache`` builds caches on the engine and storage
under test, ``rc.ENGINE`` names the engine and ``rc.STORAGE`` the storage (``"numpy"`` or
``"torch"``).

Every test that runs torch or transformers carries the ``needs_torch`` marker, applied here
(``needs_torch()`` says how it is found).  Without torch (the newcomer's ``python -m pytest``, the
``test`` extra) they skip, naming the extra to install; CI's second stage installs the ``test-torch``
extra and runs ``pytest -m needs_torch``.  The slowest tests carry ``slow`` (``SLOW``), which the plain
``python -m pytest`` leaves out (pyproject's addopts) and CI's second stage runs.  A test that skips for lack of
torch without the marker fails instead, so that the second stage cannot forget it."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

# One BLAS and OpenMP thread per process unless the caller chose (set before numpy loads, inherited by
# the workers and every command a test starts): the suite's matrices are small and two workers already
# fill two cores, where each process's extra threads only spin against the others' (a demo run 2-3x
# slower on a busy 2-core machine).
for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
    os.environ.setdefault(variable, "1")

sys.path.insert(0, str(Path(__file__).parent))  # tests/golden.py and friends, in every subject directory
from redis_servers import RedisServer  # noqa: E402
from variants import VARIANTS, package_on  # noqa: E402

pytest_plugins = ["pytester"]   # tests/tooling/test_extras.py runs this conftest on tests of its own


@pytest.fixture(params=VARIANTS, scope="module")
def rc(request):
    """The package on the engine and storage under test (the torch variant needs the torch extra)."""
    if request.param == "torch":
        pytest.importorskip("torch", reason="the torch variant needs torch: pip install '.[torch]'")
    return package_on(request.param)


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on a unix socket in the test's temporary directory (tests/redis_servers.py)."""
    server = RedisServer(tmp_path, "--maxmemory-policy", "allkeys-lru").start()
    yield server
    server.stop()


def pytest_configure(config):
    config.addinivalue_line("markers", "torch_xfail(reason): a library bug on torch storage; the test's "
                            "torch run is xfail(strict=True) until it is fixed")
    config.addinivalue_line("markers", "torch_skip(reason): the test's torch run is skipped, for the reason "
                            "given (host memory a device storage lacks, or a run that would repeat another)")


# The distributions whose tests are CI's second stage: the test-torch extra installs them.
TORCH_MODULES = ("torch", "transformers")
TORCH_MISSING = importlib.util.find_spec("torch") is None
# A skip reason that says torch or transformers is missing (importorskip's own, or a test's words).
TORCH_SKIP = re.compile(r"\b(torch|transformers)\b")


def runs_torch_variant(value: Any) -> bool:
    """Whether a value is the torch variant: ``"torch"`` or ``package_on("torch")``, or a list or
    tuple holding one."""
    if isinstance(value, (list, tuple)):
        return any(runs_torch_variant(element) for element in value)
    return (isinstance(value, str) and value == "torch") or getattr(value, "STORAGE", None) == "torch"


def imports_torch(module: types.ModuleType | None) -> bool:
    """Whether a test module imported torch or transformers (or one of their modules) at its top level."""
    return module is not None and any(
        isinstance(value, types.ModuleType) and value.__name__.split(".")[0] in TORCH_MODULES
        for value in vars(module).values())


# Tests that need torch where nothing in the test shows it, and why.
NEEDS_TORCH_BY_ID = {
    "tests/tooling/test_types_and_lint.py::test_the_whole_package_type_checks_strictly":
        "mypy --strict reads torch's own types for the torch storage and forward",
    "tests/tooling/test_bench_smoke.py::test_every_script_runs_quick[storage.py]":
        "bench/storage.py times the torch storage",
}


def needs_torch(item: pytest.Item) -> bool:
    """Whether a test runs torch: it is marked or listed in ``NEEDS_TORCH_BY_ID``, its parameters hold
    the torch variant, its module imports torch or transformers, its function reads a module-level
    torch variant (``IMPLEMENTATIONS``), or it runs a hypothesis state machine whose class holds one."""
    if item.get_closest_marker("needs_torch") is not None or item.nodeid in NEEDS_TORCH_BY_ID:
        return True
    callspec = getattr(item, "callspec", None)
    if callspec is not None and any(runs_torch_variant(value) for value in callspec.params.values()):
        return True
    module = getattr(item, "module", None)
    if imports_torch(module):
        return True
    function = getattr(item, "function", None)
    # a hypothesis test's own body is its wrapper's inner_test
    function = getattr(getattr(function, "hypothesis", None), "inner_test", function)
    code = getattr(function, "__code__", None)
    if module is not None and code is not None and any(
            runs_torch_variant(vars(module).get(name)) for name in code.co_names):
        return True
    machine = getattr(getattr(item, "obj", None), "_hypothesis_state_machine_class", None)
    return machine is not None and any(runs_torch_variant(getattr(machine, name, None)) for name in dir(machine)
                                       if not name.startswith("_"))


# The slowest tests (pytest --durations on 2 cores), by node id prefix, heaviest first: each runs the
# demo, a subprocess build, mypy, a long state machine, or a command in a real process (a second or more
# each: the package's import alone is most of one).  The fast lane (python -m pytest) leaves them to
# CI's second stage and to -m "".
SLOW = ("tests/tooling/test_types_and_lint.py::",
        "tests/core/test_compiled_matches_reference.py::TestCoreMatchesReference",
        "tests/cli/test_cli_output.py::", "tests/prefix/test_prefix_cache_machine.py::",
        "tests/core/test_hostile_callers.py::test_former_crashers_raise_package_errors[huge cache sizes]",
        "tests/tooling/test_transcripts.py::", "tests/tooling/test_bench_", "tests/capi/test_capi_examples.py::",
        "tests/cli/test_demo_prefix_cache.py::", "tests/stores/test_prefix_cache_store.py::test_another_process",
        "tests/stores/test_stores_shared.py::", "tests/prefix/test_prefix_cache_trust.py::test_saves_racing_a_thread",
        "tests/models/test_speculative.py::test_demo_", "tests/core/test_prepare.py::",
        "tests/cli/test_demo.py::test_command_line_entry_point",
        "tests/cli/test_generate.py::test_streams_in_a_real_process",
        "tests/formats/test_atomic_write.py::", "tests/formats/test_inspect.py::test_command_line_entry_point",
        "tests/formats/test_inspect_layers.py::test_a_recorded_hybrid_through_the_command",
        "tests/models/test_byte_model.py::test_held_out_bits_per_byte_recorded_and_reproduced",
        "tests/formats/test_state_format.py::test_ml_dtypes_is_imported_by_a_bf16_cache_only")


def start_rank(item: pytest.Item) -> int:
    """When a test's file should start: the files holding a hypothesis state machine first (one test of
    many seconds), then those holding ``SLOW`` tests (heaviest first, in ``SLOW``'s order), then the
    rest.  Two workers given the files longest first finish together (pyproject: --no-loadscope-reorder;
    xdist's own order, by test count, left the one-test machines and the five mypy tests to the end)."""
    if getattr(getattr(item, "obj", None), "_hypothesis_state_machine_class", None) is not None:
        return -1
    return next((index for index, prefix in enumerate(SLOW) if item.nodeid.startswith(prefix)), len(SLOW))


def in_start_order(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items`` file by file, each file at its earliest test's ``start_rank`` (a file stays whole, so its
    module fixtures are built once, with or without workers); ties keep the collection order."""
    file_rank: dict[str, int] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        file_rank[path] = min(file_rank.get(path, len(SLOW)), start_rank(item))
    return sorted(items, key=lambda item: file_rank[item.nodeid.split("::", 1)[0]])


def pytest_collection_modifyitems(items):
    """Mark ``slow`` and ``needs_torch`` (see the module's docstring) and, without torch, skip the
    latter saying what to install; apply ``torch_xfail`` / ``torch_skip`` to the torch run of a test
    (``rc`` = "torch") only; put the files in ``in_start_order``."""
    items[:] = in_start_order(items)
    for item in items:
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
        if needs_torch(item):
            item.add_marker(pytest.mark.needs_torch)
            if TORCH_MISSING:
                item.add_marker(pytest.mark.skip(reason="runs torch: pip install '.[test-torch]' "
                                                 "(CI's second stage, pytest -m 'needs_torch or slow')"))
        callspec = getattr(item, "callspec", None)
        if callspec is None or callspec.params.get("rc") != "torch":
            continue
        for marker in item.iter_markers("torch_xfail"):
            item.add_marker(pytest.mark.xfail(strict=True, reason=marker.args[0]))
        for marker in item.iter_markers("torch_skip"):
            item.add_marker(pytest.mark.skip(reason=marker.args[0]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that skips for lack of torch or transformers must carry ``needs_torch``: fail it otherwise."""
    outcome = yield
    report = outcome.get_result()
    if (report.skipped and not hasattr(report, "wasxfail") and call.excinfo is not None
            and item.get_closest_marker("needs_torch") is None):
        reason = str(call.excinfo.value)
        if TORCH_SKIP.search(reason):
            report.outcome = "failed"
            report.longrepr = (f"{item.nodeid} skips for lack of torch ({reason}) but is not marked needs_torch, "
                               "so CI's torch stage would not run it: parametrize it over the torch variant, "
                               "import torch at its module's top level, or mark it @pytest.mark.needs_torch")
