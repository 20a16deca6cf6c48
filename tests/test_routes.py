"""The route interface (``ddpad._routes.Route``: key, obtain, run, and the
first-use check's reference) and the compile manager's dispatch: a route
placed over the chain (as a CUDA graph would replay a package) takes steps
with no change to the call path; what became of each of its keys is in the
manager's records; a key it refuses, or is still building, goes to the route
below."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import pytest
import torch

import ddpad
import ddpad_toy_plugin as toy
from ddpad._routes import Route, State, Step
from test_aot import _frames, _same


class Replay:
    """A route over another: keyed by caps and call form, "built" by its
    ``obtain`` (after ``building`` calls that say it builds elsewhere), run as
    the route below's eager step (plus ``off``: a route whose numbers are wrong;
    ``raises``: one that fails on its first run)."""

    name = "replay"
    checked = True
    late_key = False

    def __init__(self, below: Route, *, building: int = 0, off: float = 0.0, raises: bool = False,
                 fallible: bool = True) -> None:
        self.fallback = below
        self.building, self.off, self.raises, self.fallible = building, off, raises, fallible
        self.obtained: list[Hashable] = []
        self.passed_keys: list[Hashable] = []
        self.refused: list[tuple[Hashable, str]] = []
        self.ran = 0

    def key(self, step: Step) -> Hashable:
        return step.key()

    def obtain(self, key: Hashable, step: Step, building: bool) -> State:
        if self.building:
            self.building -= 1
            return State.BUILDING
        self.obtained.append(key)
        return State.READY

    def run(self, key: Hashable, step: Step) -> Any:
        self.ran += 1
        if self.raises:
            raise RuntimeError("replay failed")
        out = self.reference(step, step.padded)
        step.route, step.compiled = self.name, True
        return {k: v + self.off if k == "energy" else v for k, v in out.items()}

    def reference(self, step: Step, padded: Any) -> Any:
        return self.fallback.reference(step, padded)  # type: ignore[attr-defined]

    def passed(self, key: Hashable) -> None:
        self.passed_keys.append(key)

    def refuse(self, key: Hashable, step: Step, why: str) -> None:
        self.refused.append((key, why))

    def close(self) -> None:
        self.fallback.close()


def _replayed(**replay: Any) -> tuple[ddpad.PaddedModel, Replay, torch.nn.Module, dict[str, torch.Tensor]]:
    model = toy.ADAPTER.tools.random_model()
    wrapped = ddpad.wrap(model, toy.ADAPTER, backend="aot_eager", cap_policy="headroom")
    route = Replay(wrapped.manager.route, **replay)
    wrapped.manager.route = route  # (the one change: the call path is as it was)
    return wrapped, route, model, _frames(model, 1)[0]


def _eager(model: torch.nn.Module, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return model({k: v.clone() for k, v in data.items()})


def test_a_route_over_the_chain_takes_every_step_built_once_and_checked_once() -> None:
    wrapped, route, model, data = _replayed()
    for _ in range(4):
        _same(wrapped(data), _eager(model, data))
    key = (route.obtained or [None])[0]
    assert route.obtained == [key] and route.passed_keys == [key] and route.ran == 4
    assert wrapped.manager.table.get("replay", key) is State.CHECKED
    assert [(r.route, r.compiled) for r in wrapped.manager.records.values()] == [("replay", True)]
    s = wrapped.stats
    assert (s.checks, s.disagreements, s.graphs) == (1, 0, 0)  # the route below never ran
    assert s.routes == {"replay": {"checked": 1}}


def test_a_key_whose_first_call_disagrees_goes_to_the_route_below_from_then_on() -> None:
    wrapped, route, model, data = _replayed(off=1e-3)
    for _ in range(3):
        _same(wrapped(data), _eager(model, data))  # the eager numbers on the first call, torch.compile's after
    assert route.ran == 1 and len(route.refused) == 1 and "max deviation" in route.refused[0][1]
    assert wrapped.manager.table.get("replay", route.obtained[0]) is State.REFUSED
    assert [r.route for r in wrapped.manager.records.values()] == ["torch.compile"]
    assert wrapped.stats.routes == {"replay": {"refused": 1}, "torch.compile": {"checked": 1}}
    s = wrapped.stats
    assert (s.checks, s.disagreements) == (2, 1) and s.graphs > 0  # the replay's check, then torch.compile's


def test_a_key_building_elsewhere_runs_the_route_below_until_it_is_ready() -> None:
    wrapped, route, model, data = _replayed(building=2)
    answered = []
    for _ in range(4):
        _same(wrapped(data), _eager(model, data))
        answered.append(next(iter(wrapped.manager.records.values())).route)
    assert answered == ["torch.compile", "torch.compile", "replay", "replay"]
    assert len(route.obtained) == 1 and route.ran == 2 and wrapped.stats.graphs > 0


def test_a_fallible_route_that_raises_on_its_first_run_is_refused_not_raised() -> None:
    wrapped, route, model, data = _replayed(raises=True)
    for _ in range(2):
        _same(wrapped(data), _eager(model, data))
    assert route.ran == 1 and "raised on its first call (RuntimeError: replay failed)" in route.refused[0][1]
    strict, _, _, data = _replayed(raises=True, fallible=False)  # (torch.compile's errors are the caller's)
    with pytest.raises(RuntimeError, match="replay failed"):
        strict(data)
