"""One frozen, validated record of a wrapped model's options."""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from typing import Any, Literal

from ._capacity import TightPolicy, checked_ceilings
from ._shrink import ShrinkPolicy
from ._store import CompileStore
from ._strict import OnRecompile

__all__ = ["COMPILE_SHORTHANDS", "WrapOptions", "check_cap_policy", "tight_sizing"]

# torch.compile's arguments wrap also takes by name; any other goes in compile_kwargs={...}
COMPILE_SHORTHANDS = ("backend", "mode", "fullgraph", "dynamic", "options")



def check_cap_policy(policy: Any) -> None:
    """``cap_policy`` is ``"tight"``, ``"headroom"``, a :class:`TightPolicy`
    or None, else a ``ValueError``."""
    if policy is not None and not isinstance(policy, TightPolicy) and policy not in ("tight", "headroom"):
        raise ValueError(f"ddpad: cap_policy must be 'tight', 'headroom', a TightPolicy or None (tight where "
                         f"growth is cheap), got {policy!r}")


def tight_sizing(policy: Any, cheap: bool) -> TightPolicy | None:
    """The tight sizing ``cap_policy`` asks for, or None for the padders' own
    head room; ``None`` asks for tight where a growth is ``cheap``."""
    if isinstance(policy, TightPolicy):
        return policy
    if policy is None:
        return TightPolicy() if cheap else None
    return TightPolicy() if policy == "tight" else None

@dataclasses.dataclass(frozen=True)
class WrapOptions:
    """Every option of a wrapped model, validated once (see :func:`wrap` for
    what each means). :attr:`compile_kwargs` goes to ``torch.compile``:
    ``compile_kwargs={...}`` and the arguments ``wrap`` also takes by name
    (:data:`COMPILE_SHORTHANDS`: ``backend``, ``mode``, ``fullgraph``,
    ``dynamic``, ``options``); any other keyword is a ``TypeError``."""

    compile: bool = True
    caps: Mapping[str, int] | str | os.PathLike[str] | None = None
    on_recompile: OnRecompile = "warn"
    shrink: ShrinkPolicy | None = None
    max_caps: Mapping[str, int] = dataclasses.field(default_factory=dict)
    memory_budget: int | None = None
    on_overflow: Literal["raise", "eager"] = "raise"
    compile_cache: str | os.PathLike[str] | CompileStore | None = None
    background_compile: float | None = None
    background_workers: int = 1
    warm_ladder: int = 0
    cap_policy: Literal["tight", "headroom"] | TightPolicy | None = None
    compile_mode: Literal["dynamo", "aot"] = "dynamo"
    aot_build: Literal["background", "foreground"] | None = None
    verify: bool = True
    compile_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def split(cls, kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``wrap``'s keywords as (options, ``torch.compile`` keywords).

        Raises
        ------
        TypeError
            A keyword that is neither an option nor one of
            :data:`COMPILE_SHORTHANDS` (naming the closest), or a
            ``compile_kwargs`` that is not a mapping.
        """
        names = {f.name for f in dataclasses.fields(cls)} - {"compile_kwargs"}
        for key in kwargs:
            if key not in names and key not in COMPILE_SHORTHANDS and key != "compile_kwargs":
                known = sorted(names | set(COMPILE_SHORTHANDS) | {"compile_kwargs"})
                close = difflib.get_close_matches(key, known, n=1)
                raise TypeError(f"ddpad.wrap() got an unexpected keyword {key!r}"
                                + (f": did you mean {close[0]!r}?" if close else "")
                                + " (other torch.compile arguments go in compile_kwargs={...})")
        given = kwargs.get("compile_kwargs") or {}
        if not isinstance(given, Mapping):
            raise TypeError(f"compile_kwargs must be a mapping of torch.compile's arguments, got {given!r}")
        return ({k: v for k, v in kwargs.items() if k in names},
                {**given, **{k: v for k, v in kwargs.items() if k in COMPILE_SHORTHANDS}})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> WrapOptions:
        """Options from ``wrap``'s keywords; the others are ``torch.compile``'s."""
        options, compile_kwargs = cls.split(kwargs)
        return cls(**options, compile_kwargs=compile_kwargs)

    def with_inductor_options(self, defaults: Mapping[str, Any]) -> WrapOptions:
        """These options with a model family's Inductor options
        (:attr:`~ddpad.adapters.Adapter.inductor_options`) under the
        caller's own ``options=``; unchanged unless Inductor compiles."""
        kwargs = dict(self.compile_kwargs)
        if not defaults or not self.compile or kwargs.get("backend", "inductor") != "inductor":
            return self
        kwargs["options"] = {**defaults, **(kwargs.get("options") or {})}
        return dataclasses.replace(self, compile_kwargs=kwargs)

    def tight_policy(self, store_bound: bool) -> TightPolicy | None:
        """The tight sizing this model runs under, or None for its padders'
        own head room. ``cap_policy=None`` picks tight where a growth is
        cheap: nothing compiles (``compile=False``), a compile store keeps
        every rung for the next process, background workers or a warm ladder
        compile rungs before they are needed. Elsewhere (a plain compile, no
        store) each growth is a full compile in this process that nothing
        reuses, and the head room is kept."""
        cheap = not self.compile or store_bound or self.background_compile is not None or self.warm_ladder > 0
        return tight_sizing(self.cap_policy, cheap)

    def __post_init__(self) -> None:
        check_cap_policy(self.cap_policy)
        if self.compile_mode not in ("dynamo", "aot"):
            raise ValueError(f"compile_mode must be 'dynamo' (torch.compile) or 'aot' (ahead-of-time packages), "
                             f"got {self.compile_mode!r}")
        if self.compile_mode == "aot" and not self.compile:
            raise TypeError("compile_mode='aot' compiles packages: drop compile=False")
        if self.aot_build not in (None, "background", "foreground"):
            raise ValueError(f"aot_build must be 'background' (worker processes build the packages while the run "
                             f"uses torch.compile), 'foreground' (the call that needs one builds it) or None, "
                             f"got {self.aot_build!r}")
        if self.aot_build is not None and self.compile_mode != "aot":
            raise TypeError("aot_build is an option of compile_mode='aot'")
        if self.aot_build == "background" and self.compile_cache is None:
            raise ValueError("ddpad: aot_build='background' needs compile_cache= (its workers put the packages "
                             "in the store, where this run and the next find them)")
        if not isinstance(self.verify, bool):
            raise TypeError(f"verify must be True (check every compiled graph's first call against the eager step) "
                            f"or False, got {self.verify!r}")
        if self.on_recompile not in ("warn", "raise", "ignore"):
            raise ValueError(f"on_recompile must be 'warn', 'raise' or 'ignore', got {self.on_recompile!r}")
        if self.on_overflow not in ("raise", "eager"):
            raise ValueError(f"on_overflow must be 'raise' or 'eager', got {self.on_overflow!r}")
        budget = self.memory_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"memory_budget must be a positive number of bytes, got {budget!r}")
        rungs = self.warm_ladder
        if isinstance(rungs, bool) or not isinstance(rungs, int) or rungs < 0:
            raise ValueError(f"warm_ladder must be a number of rungs >= 0, got {rungs!r}")
        object.__setattr__(self, "max_caps", checked_ceilings(self.max_caps or None))
        compile_kwargs = dict(self.compile_kwargs)
        if not self.compile:
            given = sorted([*compile_kwargs, *(["compile_cache"] if self.compile_cache is not None else []),
                            *(["background_compile"] if self.background_compile is not None else []),
                            *(["warm_ladder"] if rungs else [])])
            if given:
                raise TypeError(f"compile=False takes no compile arguments, got {given}")
        else:
            compile_kwargs.setdefault("dynamic", False)
        object.__setattr__(self, "compile_kwargs", compile_kwargs)
        threshold = self.background_compile
        if threshold is not None:
            if self.compile_cache is None:
                raise ValueError("ddpad: background_compile needs compile_cache= and an adapter (its workers "
                                 "compile into the store and rebuild the padder from the adapter)")
            if not 0.0 < float(threshold) <= 1.0:
                raise ValueError(f"ddpad: background_compile is a fill threshold in (0, 1], got {threshold!r}")
            if self.background_workers < 1:
                raise ValueError(f"ddpad: background_workers must be >= 1, got {self.background_workers!r}")
