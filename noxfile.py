"""Nox sessions: one per package (that package and its local dependencies only), plus
`integration` and `lint`.

    nox -s eplb          # install deepinfer-eplb alone into a fresh venv and run its tests
    nox -s lint          # ruff + import-linter over the workspace

Venvs are plain `venv` (uv ignores pip's config and would pull a CUDA torch) and are reused
between runs; torch is pinned to the CPU build that pip finds locally.
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["lint", "kernels", "model", "cache", "sched", "spec", "eplb", "engine", "integration"]

TORCH = "torch==2.13.0"

# Local dependencies of each package, in install order (DESIGN.md §2).
LOCAL_DEPS: dict[str, tuple[str, ...]] = {
    "kernels": (),
    "model": ("kernels",),
    "cache": (),
    "sched": ("cache",),
    "spec": ("kernels", "model"),
    "eplb": (),
    "engine": ("kernels", "model", "cache", "sched", "spec", "eplb"),
}
NEEDS_TORCH = {"kernels", "model", "spec", "engine"}


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
    session.install("ruff", "import-linter")
    session.install(*[arg for name in LOCAL_DEPS for arg in ("-e", f"packages/deepinfer-{name}")])
    session.run("ruff", "check", ".")
    session.run("lint-imports")
