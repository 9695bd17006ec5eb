"""tests/ mirrors the packages: every module of `qwen35_lib` and `playbook` with logic has its test file at the
mirrored path (`qwen35_lib/engine/scheduler.py` -> `tests/engine/test_scheduler.py`, `playbook/site.py` ->
`tests/playbook/test_site.py`; `__main__.py` -> `test_main.py`, a package's `__init__.py` -> `test_init.py`), and
every test file outside tests/integration/ is the test of a module that exists. Suites spanning many modules live in
tests/integration/; helper modules (no `test_` prefix) anywhere."""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
PACKAGES = {"qwen35_lib": pathlib.PurePosixPath(), "playbook": pathlib.PurePosixPath("playbook")}
# Modules with no logic of their own, so no test file: a package's `__init__.py` that only re-exports (or holds a
# constant), and `qwen35_lib/__init__.py`, whose one function hands its arguments to `checkpoint.load_hf_checkpoint`.
EXEMPT = {
    "qwen35_lib/__init__.py", "qwen35_lib/costmodel/__init__.py", "qwen35_lib/engine/__init__.py",
    "qwen35_lib/kernels/__init__.py", "qwen35_lib/kernels/attention/__init__.py",
    "qwen35_lib/kernels/dense/__init__.py", "qwen35_lib/kernels/gdn/__init__.py", "qwen35_lib/kernels/moe/__init__.py",
    "qwen35_lib/kernels/native/__init__.py", "qwen35_lib/kernels/permute/__init__.py", "qwen35_lib/model/__init__.py",
    "qwen35_lib/parallel/__init__.py", "qwen35_lib/parallel/hlo/__init__.py",
    "qwen35_lib/plan/__init__.py", "qwen35_lib/serve/__init__.py", "qwen35_lib/viz/__init__.py",
    "playbook/__init__.py",
}


def mirrored(module: pathlib.Path) -> pathlib.PurePosixPath:
    """tests/... path of a module's test file, relative to tests/."""
    rel = module.relative_to(ROOT)
    package, *folders, name = rel.parts
    stem = {"__main__.py": "main", "__init__.py": "init"}.get(name, name.removesuffix(".py"))
    return PACKAGES[package].joinpath(*folders, f"test_{stem}.py")


def modules() -> list[pathlib.Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_every_module_with_logic_has_its_test_file():
    missing = [f"{m.relative_to(ROOT)} -> tests/{mirrored(m)}" for m in modules()
               if m.relative_to(ROOT).as_posix() not in EXEMPT and not (TESTS / mirrored(m)).is_file()]
    assert not missing, "modules without a test file at the mirrored path:\n" + "\n".join(missing)


def test_every_test_file_mirrors_a_module():
    expected = {mirrored(m) for m in modules()}
    strays = [p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py")
              if p.relative_to(TESTS).parts[0] != "integration"
              and pathlib.PurePosixPath(p.relative_to(TESTS).as_posix()) not in expected]
    assert not strays, f"test files that mirror no module (move each next to its module, or to integration/): {strays}"


def test_the_exemptions_exist_and_have_no_test_file():
    """An exempt module that is gone, or that has a test file after all, leaves the list."""
    for name in EXEMPT:
        assert (ROOT / name).is_file(), name
        assert not (TESTS / mirrored(ROOT / name)).exists(), f"{name} has a test file: take it off EXEMPT"


def test_the_rule_catches_a_new_module(tmp_path, monkeypatch):
    """A module added without a test file fails the check; its test file at the mirrored path passes it."""
    (tmp_path / "qwen35_lib" / "engine").mkdir(parents=True)
    (tmp_path / "qwen35_lib" / "engine" / "new.py").write_text("def f():\n    return 1\n")
    (tmp_path / "tests").mkdir()
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    monkeypatch.setattr(f"{__name__}.TESTS", tmp_path / "tests")
    monkeypatch.setattr(f"{__name__}.EXEMPT", set())
    try:
        test_every_module_with_logic_has_its_test_file()
    except AssertionError as e:
        assert "qwen35_lib/engine/new.py -> tests/engine/test_new.py" in str(e)
    else:
        raise AssertionError("a module without a test file passed the check")
    (tmp_path / "tests" / "engine").mkdir()
    (tmp_path / "tests" / "engine" / "test_new.py").write_text("")
    (tmp_path / "tests" / "engine" / "test_old.py").write_text("")
    test_every_module_with_logic_has_its_test_file()
    try:
        test_every_test_file_mirrors_a_module()
    except AssertionError as e:
        assert "engine/test_old.py" in str(e) and "engine/test_new.py" not in str(e)
    else:
        raise AssertionError("a test file of no module passed the check")
