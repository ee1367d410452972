"""The dist tier's shared launches: one launch per world size for the whole session.

A test module declares `DIST_LAUNCHES = {world: cases_fn}`, where `cases_fn(folder) -> (cases,
timeout_s)` builds its cases (writing any file they read under `folder`, the module's own); a case
runs the module's `WORKER` unless it names another (`"worker": "_train_worker"`). The first module
fixture that asks `dist_launch(request.module, world)` starts ONE launch of `world` ranks
(_shared_worker.py) that runs the cases of every collected module declaring that world, in
collection order, each under its own folder; launches of smaller worlds run first (a case may resume
a smaller world's checkpoint). A rank costs ~7 s of imports, so the tier pays them once per world
size, not once per module. A failed launch fails every test that reads it, with the launch's error.
Under pytest-xdist the workers share each launch (`_cli.once`: the first builds it, the others wait
and read it).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cli import once, shared_root
from _harness import launch, rank_results

SHARED_WORKER = Path(__file__).parent / "_shared_worker.py"


class SharedLaunches:
    def __init__(self, base: Path, modules: list):
        self.base, self.modules, self.done = base, modules, {}

    def folder(self, module) -> Path:
        d = self.base / module.__name__
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _launch(self, world: int) -> None:
        key = ["dist launch", world, sorted(m.__name__ for m in self.modules if world in m.DIST_LAUNCHES)]
        self.done[world] = once(self.base, key, lambda out: self._build(world, out))

    def _build(self, world: int, out: Path) -> dict:
        cases, timeout_s = [], 0.0
        for module in self.modules:
            fn = module.DIST_LAUNCHES.get(world)
            if fn is None:
                continue
            d = self.folder(module)
            mod_cases, mod_timeout = fn(d)
            default = getattr(module, "WORKER", None)  # a case without "worker" runs its module's WORKER
            assert all("worker" in c for c in mod_cases) or default is not None, module.__name__
            cases += [{"out_dir": str(d), **({"worker": Path(default).stem} if default else {}), **c,
                       "key": f"{module.__name__}::{c['name']}"} for c in mod_cases]
            timeout_s += mod_timeout
        (out / "cases.json").write_text(json.dumps(cases))
        try:
            launch(SHARED_WORKER, world, [str(out / "cases.json"), str(out)], timeout_s, out / "logs")
            return {"results": rank_results(out, world)}
        except AssertionError as e:
            return {"error": str(e)}

    def get(self, module, world: int) -> tuple[Path, list[dict]]:
        """(the module's folder, each rank's {case name: result} for the module's cases)."""
        if module not in self.modules:
            self.modules.append(module)
        assert world in module.DIST_LAUNCHES, (module.__name__, world)
        for w in sorted({w for m in self.modules for w in m.DIST_LAUNCHES}):
            if w <= world and w not in self.done:
                self._launch(w)
        if "error" in self.done[world]:
            raise AssertionError(f"the shared {world}-rank launch failed: {self.done[world]['error']}")
        results = self.done[world]["results"]
        prefix = f"{module.__name__}::"
        return self.folder(module), [{k.removeprefix(prefix): v for k, v in r.items() if k.startswith(prefix)}
                                     for r in results]


@pytest.fixture(scope="session")
def dist_launch(request, tmp_path_factory):
    """`dist_launch(module, world) -> (folder, per-rank results)`: the module's cases from the one
    shared launch of `world` ranks (`SharedLaunches`)."""
    modules = []
    for item in request.session.items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "DIST_LAUNCHES") and module not in modules:
            modules.append(module)
    return SharedLaunches(shared_root(tmp_path_factory) / "dist", modules).get


@pytest.fixture(scope="module")
def world2(dist_launch, request) -> list[dict]:
    """Each rank's results for the requesting module's cases in the shared 2-rank launch."""
    return dist_launch(request.module, 2)[1]


@pytest.fixture(scope="module")
def world4(dist_launch, request) -> list[dict]:
    """Each rank's results for the requesting module's cases in the shared 4-rank launch."""
    return dist_launch(request.module, 4)[1]
